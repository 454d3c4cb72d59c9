"""A stock Ray Tune script whose trials each run a TorchTrainer, written the way Ray's docs write one for
Train V2 (a Tune function trainable that builds and fits the trainer, reporting through Ray's
TuneReportCallback): no raytrain import.

    python stock_tune.py --trials 2 --workers 2 --storage /shared/runs --name tuned

Each trial's run is ``<storage>/<name>-<trial id>``; the model and data are tiny and made here.
"""

from __future__ import annotations

import argparse
import os

import ray
import ray.train
from ray import tune
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from ray.tune.integration.ray_train import TuneReportCallback

from tests.user_code.stock_train import train_func


def trial(config: dict) -> None:  # type: ignore[type-arg]
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"lr": config["lr"], "epochs": config["epochs"]},
        scaling_config=ScalingConfig(num_workers=config["workers"], resources_per_worker={"CPU": 1}),
        run_config=RunConfig(
            storage_path=config["storage"],
            name=f"{config['name']}-{tune.get_context().get_trial_id()}",
            callbacks=[TuneReportCallback()],
        ),
    )
    trainer.fit()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--storage", default=os.path.expanduser("~/ray_results"))
    parser.add_argument("--name", default="tuned")
    args = parser.parse_args()
    ray.init()
    storage = os.path.abspath(args.storage)
    space = {"lr": tune.loguniform(0.01, 0.1), "epochs": args.epochs, "workers": args.workers}
    tuner = tune.Tuner(
        tune.with_resources(trial, {"CPU": 0.01}),
        param_space={**space, "storage": storage, "name": args.name},
        tune_config=tune.TuneConfig(metric="loss", mode="min", num_samples=args.trials, max_concurrent_trials=1),
        run_config=tune.RunConfig(storage_path=storage, name=f"{args.name}-tune"),
    )
    best = tuner.fit().get_best_result()
    print(f"stock tune done: best loss {best.metrics['loss']:.4f} at epoch {best.metrics['epoch']}")


if __name__ == "__main__":
    main()
