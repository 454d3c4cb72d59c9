"""raytrain measured side by side against what a user would pick instead; writes BENCHMARKS.md's results.

    bench/run.sh            # full: 5 interleaved pairs, 3 epochs each, plus ingest and checkpoint
    bench/run.sh --quick    # 3 pairs of 2 epochs, 1 ingest pass: its table judges its own time against 10 minutes

Rounds run A B S A B S ...: A = `raytrain fit` on the data, B = the torchrun DDP peer
(bench/torchrun_ddp.py) doing the same work: the same data, rows, model, batch, optimizer, schedule,
seed and threads, no training augmentation on either side (`--augment none`), and a checkpoint after
every epoch (`torch.save` from rank 0, inside its loop); S = `raytrain fit --synthetic-data` (one
pre-built batch: the model's speed with no input pipeline). Steady-state samples/s leave out the first
epoch; time to first step is counted from each command's process start (raytrain's own line; the
peer's clock starts as compare.py spawns torchrun). Ratios are taken pair by pair; medians and ranges
are reported. Then the peer again saving with `torch.distributed.checkpoint.async_save`, for the time
training is blocked by a checkpoint, and ingest alone (bench/ingest.py). The last line printed is
`throughput_ratio=<median raytrain/torchrun>`.

Where the time goes, measured in the same run: the last A and B rounds also record, over their epochs
2..N-1, CPU per process, context switches and how much of a core each training thread got
(bench/cpu_profile.py; not in --quick, whose runs are too short for that window); some B rounds
are repeated with an idle Ray cluster beside the peer; and pairs with one worker each leave a core
free for Ray's control plane. On a GPU node bench/gpu.py runs as well.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench/out"
RESULTS = REPO / "bench/results"
BEGIN, END = "<!-- bench/run.sh: begin generated section -->", "<!-- bench/run.sh: end generated section -->"
COMMON = {"batch_size": 64, "lr": 0.02, "seed": 0, "image_size": 32}


def steady(epochs: list[dict[str, Any]]) -> float:
    """Samples per second over every epoch but the first (warm-up)."""
    rest = epochs[1:] or epochs
    return float(sum(e["train_samples"] for e in rest) / sum(e["train_time_s"] for e in rest))


def data_wait(epochs: list[dict[str, Any]]) -> float:
    """Share of steady-state training time spent waiting for a batch."""
    rest = epochs[1:] or epochs
    return float(sum(e["data_wait_s"] for e in rest) / sum(e["train_time_s"] for e in rest))


def raytrain_command(
    data: Path, storage: Path, name: str, epochs: int, synthetic: bool, workers: int = 2, seed: int = COMMON["seed"]
) -> list[str]:
    cmd = [sys.executable, "-m", "raytrain", "fit", "--workers", str(workers), "--device", "cpu", "--data", str(data),
           "--storage", str(storage), "--name", name, "--fresh", "--epochs", str(epochs),
           "--batch-size", str(COMMON["batch_size"]), "--lr", str(COMMON["lr"]),
           "--seed", str(seed), "--augment", "none"]  # fmt: skip
    return [*cmd, "--synthetic-data"] if synthetic else cmd


def execute(cmd: list[str], env: dict[str, str], profile: bool, what: str) -> dict[str, Any] | None:
    """Run one side's command to completion; with profile, under bench/cpu_profile.py, returning its figures."""
    import cpu_profile  # next to this file

    if profile:
        return cpu_profile.profile(cmd, env)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed:\n{proc.stdout}\n{proc.stderr}")
    return None


def run_raytrain(
    data: Path,
    storage: Path,
    name: str,
    epochs: int,
    synthetic: bool,
    workers: int = 2,
    profile: bool = False,
    seed: int = COMMON["seed"],
) -> dict[str, Any]:
    """One `raytrain fit`; with profile, also where its CPU goes over epochs 2..N-1 (bench/cpu_profile.py).
    ``seed``: the model's start and the data order, as the peer's ``seed`` sets both."""
    cmd = raytrain_command(data, storage, name, epochs, synthetic, workers, seed)
    t0 = time.time()
    cpu = execute(cmd, {**os.environ, "RAY_ADDRESS": ""}, profile, "raytrain fit")
    result = json.loads((storage / name / "result.json").read_text())
    hist = result["history"]
    return {
        "samples_per_s": steady(hist),
        "first_step_s": result["startup_s"]["first_step"],
        "workers_up_s": result["startup_s"]["worker"],
        "first_batch_s": result["startup_s"]["first_batch"],
        "final_loss": hist[-1]["train_loss"],
        "data_wait_fraction": data_wait(hist),
        "checkpoint_blocked_s": [e["checkpoint_blocked_s"] for e in hist if e.get("checkpoint_blocked_s")],
        "wall_s": time.time() - t0,
        "last_checkpoint": result["last_checkpoint"],
        **({"cpu_profile": cpu} if cpu else {}),
    }


def run_torchrun(
    data: Path,
    out: Path,
    epochs: int,
    workers: int = 2,
    seed: int = COMMON["seed"],
    profile: bool = False,
    save: str = "torch",
) -> dict[str, Any]:
    """One run of the peer, saving a checkpoint after each epoch as raytrain does (``save``: bench/
    torchrun_ddp.py's --save) next to ``out``. ``seed`` sets the model's start and the data order, as
    raytrain's --seed does; each round gives both sides its own, so both final losses carry the seeds'
    noise and compare as distributions."""
    t0 = time.time()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(workers),
           str(REPO / "bench/torchrun_ddp.py"), "--data", str(data), "--epochs", str(epochs),
           "--batch-size", str(COMMON["batch_size"]), "--lr", str(COMMON["lr"]), "--seed", str(seed),
           "--save", save, "--save-dir", str(out.parent),
           "--out", str(out)]  # fmt: skip
    cpu = execute(cmd, {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_T0": str(t0)}, profile, "torchrun peer")
    result = json.loads(out.read_text())
    hist = result["epochs"]
    return {
        "samples_per_s": steady(hist),
        "first_step_s": result["first_step_s"],
        "final_loss": hist[-1]["train_loss"],
        "data_wait_fraction": data_wait(hist),
        "checkpoint_blocked_s": [e["checkpoint_blocked_s"] for e in hist if e.get("checkpoint_blocked_s")],
        "wall_s": time.time() - t0,
        **({"cpu_profile": cpu} if cpu else {}),
    }


IDLE_RAY = """
import sys
from raytrain.service import cluster
with cluster.connect(dashboard=True):
    print("ready", flush=True)
    sys.stdin.read()
"""


def run_torchrun_beside_idle_ray(data: Path, out: Path, epochs: int, seed: int) -> dict[str, Any]:
    """The peer again, with an idle Ray cluster (as `raytrain fit` starts one, dashboard on) beside it."""
    ray_proc = subprocess.Popen([sys.executable, "-c", IDLE_RAY], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, env={**os.environ, "RAY_ADDRESS": ""})  # fmt: skip
    try:
        assert ray_proc.stdout is not None and ray_proc.stdout.readline().strip() == "ready", "idle Ray did not start"
        return run_torchrun(data, out, epochs, seed=seed)
    finally:
        ray_proc.communicate("", timeout=120)


def checkpoint_samples(res: dict[str, Any]) -> dict[str, list[float]]:
    """Training blocked by each side's checkpoints, the same saves on every side: raytrain's epochs report
    the save before them (epochs 2..N: the saves after epochs 1..N-1), so each peer run's last save,
    after epoch N, is left out too."""
    return {
        "raytrain_blocked_s": [s for r in res["raytrain"] for s in r["checkpoint_blocked_s"]],
        "torch_save_s": [s for r in res["torchrun"] for s in r["checkpoint_blocked_s"][:-1]],
        "dcp_async_save_s": [s for r in res["torchrun_dcp"] for s in r["checkpoint_blocked_s"][:-1]],
    }


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def gpu_section(res: dict[str, Any]) -> str:
    if "gpu" in res:
        import gpu

        return gpu.markdown(res["gpu"])
    return (
        "GPU (ResNet-50, bf16, channels_last, one GPU, raytrain against the plain PyTorch loop): **not run**, "
        "this machine has no GPU. On a GPU node `bench/run.sh` runs it too (bench/gpu.py, on its own: "
        "`.venv/bin/python bench/gpu.py`); targets >= 4,000 img/s on an H100 and a ratio >= 0.98."
    )


def med(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float], digits: int = 0) -> str:
    """Median and range, as '123 (110-130)'; one sample is a figure, '123 (1 run)', never a range."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f} (1 run)"
    return f"{med(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def overlap(a: list[float], b: list[float]) -> str:
    """Whether two samples' ranges overlap: with a handful of runs a side, the honest 'within noise' test."""
    return "ranges overlap" if max(min(a), min(b)) <= min(max(a), max(b)) else "ranges apart"


def over_load(passes: list[dict[str, Any]]) -> float:
    """Images/s over an in-memory side's one load and all its passes."""
    return sum(p["images"] for p in passes) / (passes[0]["load_s"] + sum(p["seconds"] for p in passes))


def by_role(prof: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in sorted(prof["cores_by_role"].items(), key=lambda kv: -kv[1]))


def trainer(prof: dict[str, Any]) -> str:
    """The training threads' median share of a core and preemptions per second."""
    threads = prof["training_threads"]
    if not threads:
        return "not measured"
    return f"{med([t['cores'] for t in threads]):.2f}, {med([t['preempted_per_s'] for t in threads]):.0f}/s"


def machine() -> str:
    info = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), "?")
    mem_kb = next(
        int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal")
    )
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()} cores ({cpu}), {mem_kb // 1024**2} GiB, {platform.platform()}, {gpu}"


def versions() -> str:
    import ray
    import torch
    import torchvision

    import raytrain

    return (
        f"raytrain {raytrain.__version__}, Ray {ray.__version__}, torch {torch.__version__}, "
        f"torchvision {torchvision.__version__}, Python {platform.python_version()}"
    )


def plot(res: dict[str, Any], path: Path, command: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    pairs = range(1, len(res["raytrain"]) + 1)
    for key, label in (
        ("raytrain", "raytrain fit"),
        ("torchrun", "torchrun DDP peer"),
        ("synthetic", "raytrain, one pre-built batch"),
    ):
        ax1.plot(list(pairs)[: len(res[key])], [r["samples_per_s"] for r in res[key]], "o-", label=label)
    ax1.set_xticks(list(pairs))
    ax1.set_xlabel("round")
    ax1.set_ylabel("steady-state samples/s (2 workers)")
    ax1.set_ylim(bottom=0)
    ax1.legend(fontsize=8)
    ax1.set_title("Training throughput, interleaved")
    names = ["time to first step (s)", "checkpoint blocked (s)"]
    ours = [med([r["first_step_s"] for r in res["raytrain"]]), med(res["checkpoint"]["raytrain_blocked_s"])]
    peer = [med([r["first_step_s"] for r in res["torchrun"]]), med(res["checkpoint"]["torch_save_s"])]  # in its loop
    x = range(len(names))
    ax2.bar([i - 0.2 for i in x], ours, width=0.4, label="raytrain")
    ax2.bar([i + 0.2 for i in x], peer, width=0.4, label="peer (torchrun / torch.save)")
    ax2.set_xticks(list(x), names)
    ax2.set_yscale("log")
    ax2.legend(fontsize=8)
    ax2.set_title("Start-up and checkpoint (medians)")
    fig.text(0.01, 0.01, f"{command}, {res['date']}; {res['machine']}\n{res['versions']}", fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)


def markdown(res: dict[str, Any], command: str) -> str:
    def col(runs: list[dict[str, Any]], key: str) -> list[float]:
        return [float(x[key]) for x in runs]

    r, t, s = res["raytrain"], res["torchrun"], res["synthetic"]
    ratios = [a / b for a, b in zip(col(r, "samples_per_s"), col(t, "samples_per_s"), strict=False)]
    data_ratio = med(col(r, "samples_per_s")) / med(col(s, "samples_per_s"))
    ing, ck = res["ingest"], res["checkpoint"]
    streamed, loader = col(ing["raytrain_streamed"], "images_per_s"), col(ing["dataloader"], "images_per_s")
    mem_r, mem_p = over_load(ing["raytrain_in_memory"]), over_load(ing["by_hand_in_memory"])
    first_r, first_t = med(col(r, "first_step_s")), med(col(t, "first_step_s"))
    blocked, saved, dcp = med(ck["raytrain_blocked_s"]), med(ck["torch_save_s"]), med(ck["dcp_async_save_s"])
    loss_r, loss_t = col(r, "final_loss"), col(t, "final_loss")
    rows = [
        ("training samples/s, median (range)", spread(col(r, "samples_per_s")),
         f"torchrun DDP {spread(col(t, 'samples_per_s'))}", f"**{med(ratios):.3f}** pairwise "
         f"({min(ratios):.3f}-{max(ratios):.3f}), target >= 0.99"),
        ("time to first step from the command's process start, s",
         f"{first_r:.1f} (workers up at {med(col(r, 'workers_up_s')):.1f}, "
         f"first batch at {med(col(r, 'first_batch_s')):.1f})", f"torchrun {first_t:.1f}", f"{first_r / first_t:.2f}"),
        ("final training loss (each round both sides start from its own seed: model and data order)", spread(loss_r, 3),
         f"torchrun {spread(loss_t, 3)}", f"{med(loss_r) / med(loss_t):.2f}; {overlap(loss_r, loss_t)}"),
        ("real data vs one pre-built batch, samples/s", f"{med(col(r, 'samples_per_s')):.0f}",
         f"pre-built {spread(col(s, 'samples_per_s'))}", f"**{data_ratio:.3f}**, target >= 0.97"),
        ("share of training time waiting for data", f"{100 * med(col(r, 'data_wait_fraction')):.1f}%",
         f"torchrun {100 * med(col(t, 'data_wait_fraction')):.1f}%", ""),
        ("ingest, streamed (read, shuffle, decode), img/s", spread(streamed),
         f"DataLoader, persistent workers {spread(loader)}", f"{med(streamed) / med(loader):.2f}"),
        ("ingest, time to first batch, s", spread(col(ing["raytrain_streamed"], "first_batch_s"), 2),
         f"DataLoader {spread(col(ing['dataloader'], 'first_batch_s'), 2)}", ""),
        (f"ingest, held in memory: the load and {len(ing['raytrain_in_memory'])} passes, img/s "
         f"(load s)", f"{mem_r:.0f} ({ing['raytrain_in_memory'][0]['load_s']:.2f})",
         f"by hand over decoded tensors {mem_p:.0f} ({ing['by_hand_in_memory'][0]['load_s']:.2f})",
         f"{mem_r / mem_p:.2f}"),
        ("training blocked by one checkpoint, s", spread(ck["raytrain_blocked_s"], 3),
         f"torch.save in the peer's loop {spread(ck['torch_save_s'], 3)}", f"{blocked / saved:.2f}"),
        ("training blocked by one checkpoint, s", spread(ck["raytrain_blocked_s"], 3),
         f"dcp.async_save in the peer's loop {spread(ck['dcp_async_save_s'], 3)}", f"{blocked / dcp:.2f}"),
    ]  # fmt: skip
    beside = col(res["torchrun_beside_ray"], "samples_per_s")
    alone = col(t[: len(beside)], "samples_per_s")
    rows.append(("peer with an idle raytrain Ray cluster beside it, samples/s", spread(beside),
                 f"torchrun alone, same rounds {spread(alone)}",
                 f"{med([a / b for a, b in zip(beside, alone, strict=True)]):.3f}"))  # fmt: skip
    one_r, one_t = col(res["headroom_raytrain"], "samples_per_s"), col(res["headroom_torchrun"], "samples_per_s")
    rows.append(("1 worker each (a core left for Ray's control plane), samples/s", spread(one_r),
                 f"torchrun, 1 process {spread(one_t)}",
                 f"{med([a / b for a, b in zip(one_r, one_t, strict=True)]):.3f}"))  # fmt: skip
    if "cpu_profile" in res:
        prof, peer = res["cpu_profile"], res["cpu_profile_torchrun"]
        rows.append((f"CPU cores in use during epochs 2..N-1 (of {prof['cores']}), last round", by_role(prof),
                     f"torchrun: {by_role(peer)}", ""))  # fmt: skip
        rows.append(("training thread: share of a core, times preempted per s (median of workers)",
                     trainer(prof), f"torchrun {trainer(peer)}", ""))  # fmt: skip
        rows.append(("context switches per s, whole process tree", f"{prof['context_switches_per_s']:.0f}",
                     f"torchrun {peer['context_switches_per_s']:.0f}", ""))  # fmt: skip
    else:
        rows.append(("where the CPU goes (bench/cpu_profile.py)", "not measured: runs of 2 epochs; it needs 3",
                     "", ""))  # fmt: skip
    head = [
        f"Command: `{command}`; {res['date']}; machine: {res['machine']}; {res['versions']}.",
        f"Workload, the same on both sides: ResNet-18, 32x32 digits ({res['rows']} rows: jittered copies made "
        "by bench/make_data.py, 80% train), no training augmentation, 2 CPU workers, batch 64 per worker, "
        "SGD(0.02, momentum 0.9, Nesterov, wd 5e-4), cosine schedule per epoch, round i's seed on both sides "
        "(the model's start and the data order), one thread per "
        f"worker, a checkpoint after every epoch; {res['epochs']} epochs per run, steady state = epochs "
        f"2..{res['epochs']}; {len(r)} interleaved rounds.",
        "",
        "| measure | raytrain | peer | ratio |",
        "|---|---|---|---|",
    ]
    return "\n".join([*head, *(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows), "",
                      "![throughput, start-up and checkpoint](bench/results/bench.png)", "",
                      gpu_section(res), "", targets(res, ratios, data_ratio, blocked / dcp)])  # fmt: skip


def targets(res: dict[str, Any], ratios: list[float], data_ratio: float, blocked_ratio: float) -> str:
    """The targets this comparison was set against, judged from this run's figures alone."""

    def verdict(ok: bool) -> str:
        return "**met**" if ok else "**not met**"

    ck = res["checkpoint"]
    blocked_ranges = overlap(ck["raytrain_blocked_s"], ck["dcp_async_save_s"])
    loss_r = [x["final_loss"] for x in res["raytrain"]]
    loss_t = [x["final_loss"] for x in res["torchrun"]]
    same = overlap(loss_r, loss_t) == "ranges overlap"
    rows = [
        ("raytrain / torchrun steady-state samples/s >= 0.99", f"{med(ratios):.3f} ({min(ratios):.3f}-"
         f"{max(ratios):.3f})", verdict(med(ratios) >= 0.99)),
        ("both reach the same training loss", f"{spread(loss_r, 3)} against {spread(loss_t, 3)}",
         f"{verdict(same)}: the {overlap(loss_r, loss_t)}"),
        ("real data / one pre-built batch >= 0.97", f"{data_ratio:.3f}", verdict(data_ratio >= 0.97)
         + (": above 1, which only noise can give (one pre-built batch is the upper bound)" if data_ratio > 1 else "")),
        ("training blocked by a checkpoint no longer than by the peer's dcp.async_save in its loop (both write "
         "in the background)", f"{blocked_ratio:.2f} of it",
         f"{verdict(blocked_ratio <= 1.0)} at the median; the {blocked_ranges}"
         + (", so a shorter block than the peer's is not shown" if blocked_ranges == "ranges overlap" else "")),
    ]  # fmt: skip
    if "gpu" in res:
        g = res["gpu"]
        rows.append(("one GPU, ResNet-50: raytrain / plain >= 0.98 and >= 4,000 img/s",
                     f"{med(g['ratios']):.3f}, {med(g['raytrain']):.0f} img/s",
                     verdict(med(g["ratios"]) >= 0.98 and med(g["raytrain"]) >= 4000)))  # fmt: skip
    if res.get("quick"):
        minutes = res["elapsed_s"] / 60
        rows.append(("`bench/run.sh --quick` under 10 minutes (compare.py's own time, set-up apart)",
                     f"{minutes:.1f} min", verdict(minutes < 10)))  # fmt: skip
    lines = ["Against the targets (this run's figures only):", "", "| target | this run | |", "|---|---|---|"]
    return "\n".join([*lines, *(f"| {a} | {b} | {c} |" for a, b, c in rows)])


def write_benchmarks(section: str) -> None:
    path = REPO / "BENCHMARKS.md"
    text = path.read_text()
    block = f"{BEGIN}\n{section}\n{END}"
    if BEGIN in text:
        text = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END) :]
    else:
        text += f"\n{block}\n"
    path.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-write", action="store_true", help="do not touch BENCHMARKS.md and bench/results")
    ap.add_argument("--render", action="store_true", help="only write BENCHMARKS.md again from bench/results")
    a = ap.parse_args()
    if a.render:  # the section as this script now draws it, from the figures of the last run
        res = json.loads((RESULTS / "results.json").read_text())
        res["checkpoint"] = checkpoint_samples(res)  # as this script now selects them, kept with the rest
        (RESULTS / "results.json").write_text(json.dumps(res, indent=1))
        command = "bench/run.sh --quick" if res.get("quick") else "bench/run.sh"
        write_benchmarks(markdown(res, command))
        plot(res, RESULTS / "bench.png", command)
        return
    began = time.monotonic()
    rounds, epochs, passes, rows, headroom = (3, 2, 1, 4000, 1) if a.quick else (5, 3, 3, 6000, 3)
    OUT.mkdir(parents=True, exist_ok=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = OUT / f"digits-aug-{rows}.parquet"
    if not data.exists():
        subprocess.run([sys.executable, str(REPO / "bench/make_data.py"), str(data), "--rows", str(rows)], check=True)
    res: dict[str, Any] = {"rows": rows, "epochs": epochs}
    profiled = epochs >= 3  # bench/cpu_profile.py's window is epochs 2..N-1
    for key in ("raytrain", "torchrun", "synthetic", "torchrun_beside_ray", "headroom_raytrain", "headroom_torchrun"):
        res[key] = []
    with tempfile.TemporaryDirectory(dir=OUT) as tmp:
        storage = Path(tmp)
        for i in range(rounds):
            res["raytrain"].append(
                run_raytrain(data, storage, f"real{i}", epochs, False, profile=profiled and i == rounds - 1, seed=i)
            )
            res["torchrun"].append(
                run_torchrun(data, storage / f"peer{i}.json", epochs, seed=i, profile=profiled and i == rounds - 1)
            )
            if i < max(2, rounds - 2):
                res["synthetic"].append(run_raytrain(data, storage, f"synth{i}", epochs, synthetic=True, seed=i))
            if i < max(1, rounds - 2):
                res["torchrun_beside_ray"].append(
                    run_torchrun_beside_idle_ray(data, storage / f"peer{i}b.json", epochs, seed=i)
                )
            print(f"round {i + 1}/{rounds}: raytrain {res['raytrain'][-1]['samples_per_s']:.0f}, "
                  f"torchrun {res['torchrun'][-1]['samples_per_s']:.0f} samples/s", flush=True)  # fmt: skip
        if profiled:
            res["cpu_profile"] = res["raytrain"][-1].pop("cpu_profile")
            res["cpu_profile_torchrun"] = res["torchrun"][-1].pop("cpu_profile")
        for i in range(headroom):  # one worker each: a core left free for Ray's control plane
            res["headroom_raytrain"].append(run_raytrain(data, storage, f"one{i}", epochs, False, workers=1, seed=i))
            res["headroom_torchrun"].append(run_torchrun(data, storage / f"one{i}.json", epochs, workers=1, seed=i))
        # The peer once more (twice in full), saving with DCP's async_save instead, for the checkpoint row.
        res["torchrun_dcp"] = [
            run_torchrun(data, storage / f"dcp{i}.json", epochs, seed=i, save="dcp-async")
            for i in range(max(1, headroom - 1))
        ]
        res["checkpoint"] = checkpoint_samples(res)
        ingest_out = storage / "ingest.json"
        subprocess.run([sys.executable, str(REPO / "bench/ingest.py"), str(data), "--passes", str(passes),
                        "--out", str(ingest_out)], check=True, capture_output=True)  # fmt: skip
        res["ingest"] = json.loads(ingest_out.read_text())
    if cuda_available():
        import gpu  # bench/gpu.py, next to this file

        res["gpu"] = gpu.measure(rounds=1 if a.quick else 3, workdir=OUT)
    res["quick"] = a.quick
    res["elapsed_s"] = time.monotonic() - began
    res["date"] = dt.date.today().isoformat()
    res["machine"] = machine()
    res["versions"] = versions()
    ratio = med(
        [x["samples_per_s"] / y["samples_per_s"] for x, y in zip(res["raytrain"], res["torchrun"], strict=False)]
    )
    command = "bench/run.sh --quick" if a.quick else "bench/run.sh"
    section = markdown(res, command)
    print(section)
    if not a.no_write:
        (RESULTS / "results.json").write_text(json.dumps(res, indent=1))
        plot(res, RESULTS / "bench.png", command)
        write_benchmarks(section)
    print(f"throughput_ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
