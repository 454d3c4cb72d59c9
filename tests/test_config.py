import dataclasses

import pytest

from raytrain.errors import UserError
from raytrain.recipe.config import DataConfig, FitConfig, OptimConfig
from raytrain.service.config import RunConfig, ScaleConfig, fingerprint


def make(**optim: object) -> FitConfig:
    return FitConfig(optim=OptimConfig(**optim))  # type: ignore[arg-type]


def test_round_trip_through_dict() -> None:
    cfg = make(epochs=3, lr=0.1)
    assert FitConfig.from_dict(cfg.to_dict()) == cfg


def test_experiment_ignores_what_may_change_between_attempts() -> None:
    base = make(epochs=3)
    longer = dataclasses.replace(base, optim=dataclasses.replace(base.optim, epochs=30))
    assert fingerprint(base.experiment()) == fingerprint(longer.experiment())


def test_fingerprint_changes_with_the_experiment() -> None:
    assert fingerprint(make(lr=0.02).experiment()) != fingerprint(make(lr=0.05).experiment())
    other_data = dataclasses.replace(make(), data=DataConfig(uri="/other"))
    assert fingerprint(make().experiment()) != fingerprint(other_data.experiment())


@pytest.mark.parametrize(
    ("build", "flag"),
    [
        (lambda: ScaleConfig(workers=0), "--workers 0"),
        (lambda: ScaleConfig(pg_timeout_s=1), "--pg-timeout"),
        (lambda: OptimConfig(epochs=0), "--epochs 0"),
        (lambda: OptimConfig(batch_size=0), "--batch-size 0"),
        (lambda: OptimConfig(lr=-1), "--lr -1"),
        (lambda: DataConfig(val_fraction=1.0), "--val-fraction"),
        (lambda: RunConfig(storage="/s", name="a/b"), "--name"),
        (lambda: RunConfig(storage="/s", name="r", keep=0), "--keep 0"),
    ],
)
def test_invalid_values_name_their_flag(build: object, flag: str) -> None:
    with pytest.raises(UserError, match=flag):
        build()  # type: ignore[operator]
