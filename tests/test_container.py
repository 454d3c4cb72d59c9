"""The command lines that put a job inside its image, one builder for all three runtimes (raytrain.launch.
container). Podman runs for real on the testbed (test_container_slurm); Apptainer and Pyxis cannot be
installed here, so their command lines are checked against each runtime's documented flags: Apptainer's
`exec` (--nv, --bind src[:dest[:opts]], --pwd, --env), Pyxis's srun options (--container-image,
--container-mounts=SRC:DST[:FLAGS], --container-workdir) and Podman's `run`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from raytrain.contracts import env
from raytrain.errors import UserError
from raytrain.launch import container
from raytrain.launch.container import Answer, Container
from tests.conftest import run_cli

ARGV = ["python3", "-m", "raytrain.launch", "node", "--role", "head"]
BINDS = ("/home/ada", "/tmp", "/scratch/data:/data:ro")


def image(runtime: container.Runtime, command: str, img: str, flags: tuple[str, ...] = ()) -> Container:
    return Container(image=img, runtime=runtime, command=command, binds=BINDS, flags=flags, python="python3")


def test_apptainer_exec_with_the_gpus_binds_and_workdir() -> None:
    sif = image("apptainer", "apptainer", "/shared/pytorch.sif", ("--writable-tmpfs",))
    argv = sif.run_argv(ARGV, workdir="/home/ada/exp", gpus=["2", "3"], name="unused", job_id="7", node="n1")
    assert argv == [
        "apptainer",
        "exec",
        "--nv",
        "--bind=/home/ada,/tmp,/scratch/data:/data:ro",
        "--pwd=/home/ada/exp",
        f"--env={env.CONTAINED.name}=1",
        "--writable-tmpfs",
        "/shared/pytorch.sif",
        *ARGV,
    ]
    # A working directory no bind covers (raytrain submit from elsewhere) is bound too: its files are the host's.
    elsewhere = sif.run_argv(ARGV, workdir="/scratch/ada", gpus=[], name="unused", job_id="7", node="n1")
    assert "--nv" not in elsewhere and "--bind=/home/ada,/tmp,/scratch/data:/data:ro,/scratch/ada" in elsewhere
    assert sif.srun_options("/w", "7") == []  # Apptainer runs inside the step, not as an option of srun


def test_pyxis_puts_the_step_itself_in_the_image(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in container.pyxis_env_names(os.environ):  # none to name in --container-env (the next test's)
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.chdir("/tmp")
    sqsh = image("pyxis", "srun", "nvcr.io#nvidia/pytorch:24.05-py3")
    argv = container.step_argv(sqsh, tmp_path, ARGV, node="gpu3", step="ray-head-gpu3")
    at = argv.index("--container-image=nvcr.io#nvidia/pytorch:24.05-py3")
    assert argv[:at] == [
        "srun",
        "--nodes=1",
        "--ntasks=1",
        "--nodelist=gpu3",
        "--whole",
        "--overlap",
        "--job-name=ray-head-gpu3",
    ]
    assert argv[at:] == [
        "--container-image=nvcr.io#nvidia/pytorch:24.05-py3",
        "--container-name=raytrain-7",  # one container a node for the job's steps: imported once
        "--container-mounts=/home/ada:/home/ada,/tmp:/tmp,/scratch/data:/data:ro",
        "--container-workdir=/tmp",
        f"--export=ALL,{env.CONTAINED.name}=1",
        *ARGV,  # run by the image's interpreter: no wrapper command in the step
    ]


def test_pyxis_lets_the_jobs_own_variables_win_over_the_images_by_name() -> None:
    """Pyxis gives a step every host variable, but where the image sets one too (its ENV) the image's value
    wins unless the variable is named in --container-env (Pyxis's README and tests/env.bats): raytrain's
    and Ray's, NCCL's and Gloo's, and the user's are; the image's CUDA_*, PATH and LD_LIBRARY_PATH stay."""
    environ = {
        "RAY_AUTH_TOKEN_PATH": "/secret/token",
        env.DASHBOARD_METRIC_PORT.name: "45123",  # in raytrain's table, with no RAY_ prefix
        "NCCL_SOCKET_IFNAME": "ib0",
        "WANDB_PROJECT": "p",
        "MY_KEY": "1",
        "CUDA_VERSION": "12.8",
        "LD_LIBRARY_PATH": "/opt/lib",
        "PATH": "/usr/bin",
        "OTHER": "x",
    }
    sqsh = Container(
        image="img.sqsh", runtime="pyxis", command="srun", binds=(), flags=(), python="python3",
        passed=("MY_KEY", "WANDB_*"),
    )  # fmt: skip
    names = [env.DASHBOARD_METRIC_PORT.name, "MY_KEY", "NCCL_SOCKET_IFNAME", "RAY_AUTH_TOKEN_PATH", "WANDB_PROJECT"]
    assert container.pyxis_env_names(environ, sqsh.passed) == sorted(names)
    opts = sqsh.srun_options("/w", "7", environ)
    assert opts[-1] == f"--container-env={','.join(sorted(names))}"
    assert "/secret/token" not in " ".join(opts)  # names only: Pyxis takes the values from the step


def test_apptainer_and_podman_steps_start_their_container_on_the_node(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The head builds the step; the node's host helper builds the container, with that node's GPUs."""
    monkeypatch.setenv(env.PYTHON.name, "/opt/rt/bin/python")
    oci = image("podman", "podman", "localhost/train:1")
    argv = container.step_argv(oci, tmp_path, ARGV, node="n2", step="ray-worker-n2")
    at = argv.index("--job-name=ray-worker-n2") + 1
    assert argv[at:] == [
        *("/opt/rt/bin/python", "-m", "raytrain.launch", "in-image", "--job-dir", str(tmp_path)),
        *("--step", "ray-worker-n2", "--", *ARGV),
    ]


@pytest.mark.parametrize(
    ("environ", "gpus"),
    [
        ({"SLURM_JOB_ID": "7", "SLURM_GPUS_ON_NODE": "0"}, []),
        (
            {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "3", "SLURM_GPUS_ON_NODE": "2", "SLURM_STEP_GPUS": "2,3"}
            | {"SLURM_JOB_GPUS": "0,1"},
            ["2", "3"],
        ),
        ({"SLURM_JOB_ID": "7", "SLURM_GPUS_ON_NODE": "2", "SLURM_JOB_GPUS": "4,5"}, ["4", "5"]),  # the batch script
        # A step elsewhere: srun copied the batch script's SLURM_JOB_GPUS, which names the first node's GPUs.
        ({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "3", "SLURM_GPUS_ON_NODE": "2", "SLURM_JOB_GPUS": "4,5"}, ["all"]),
        ({"SLURM_JOB_ID": "7", "SLURM_GPUS_ON_NODE": "2"}, ["all"]),
        ({"CUDA_VISIBLE_DEVICES": "0"}, ["all"]),
        ({}, []),
    ],
)
def test_a_nodes_gpus_come_from_slurm(environ: dict[str, str], gpus: list[str]) -> None:
    assert container.gpus_here(environ) == gpus


def test_podman_shares_the_hosts_namespaces_and_passes_variables_by_name_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/home/ada/.raytrain/jobs/7/token")
    oci = image("podman", "podman", "localhost/train:1", ("--shm-size=1g",))
    argv = oci.run_argv(
        ARGV, workdir="/home/ada/exp", gpus=["2", "3"], name="raytrain-7.0-ray-head-n1-9", job_id="7", node="n1", euid=0
    )
    image_at = argv.index("localhost/train:1")
    assert argv[image_at + 1 :] == ARGV and argv[image_at - 1] == "--shm-size=1g"
    head = argv[:image_at]
    assert head[:6] == [
        *("podman", "run", "--rm", "--name=raytrain-7.0-ray-head-n1-9"),
        *("--label=raytrain.job=7", "--label=raytrain.node=n1"),
    ]
    for flag in ("--network=host", "--pid=host", "--ipc=host", "--workdir=/home/ada/exp"):
        assert flag in head
    # The job's GPUs only (CDI), numbered from 0 inside, where they are the only ones.
    assert [a for a in head if a.startswith("--device=")] == ["--device=nvidia.com/gpu=2", "--device=nvidia.com/gpu=3"]
    assert [a for a in head if a.startswith("--volume=")] == [
        "--volume=/home/ada:/home/ada",
        "--volume=/tmp:/tmp",
        "--volume=/scratch/data:/data:ro",
    ]
    names = [a.removeprefix("--env=") for a in head if a.startswith("--env=")]
    # Every variable of raytrain's contract reaches the processes inside, each copied from the caller by
    # its name: no value, the token's path included, is ever on the command line (but raytrain's own mark).
    assert names[-2:] == ["CUDA_VISIBLE_DEVICES=0,1", f"{env.CONTAINED.name}=1"]
    assert all("=" not in n for n in names[:-2])
    for var in env.TABLE:
        assert any(var.name == n or (n.endswith("*") and var.name.startswith(n[:-1])) for n in names), var.name
    assert not any("/token" in a for a in argv)
    assert "--userns=keep-id" not in head  # rootful: root inside
    rootless = oci.run_argv(ARGV, workdir="/home/ada", gpus=[], name="n", job_id="7", node="n1", euid=1000)
    assert "--userns=keep-id" in rootless and not any(a.startswith("--device") for a in rootless)
    assert not any(a.startswith("--env=CUDA_VISIBLE_DEVICES=") for a in rootless)
    # Slurm gave a count only: a container outside the step's cgroup would see every GPU of the node.
    with pytest.raises(UserError, match=r"Slurm names none of n1's GPUs for this step .* use Apptainer or Pyxis$"):
        oci.run_argv(ARGV, workdir="/home/ada", gpus=["all"], name="n", job_id="7", node="n1", euid=0)
    assert "--nv" in image("apptainer", "apptainer", "a.sif").run_argv(
        ARGV, workdir="/w", gpus=["all"], name="n", job_id="7", node="n1"
    )  # Apptainer runs inside the step: its cgroup holds the job's GPUs only


def test_the_job_keeps_its_container_in_its_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "train.sif").write_bytes(b"")
    monkeypatch.chdir(tmp_path / "exp")
    monkeypatch.setenv(env.CONTAINER.name, "train.sif")
    monkeypatch.setenv(env.CONTAINER_MOUNTS.name, "/scratch,/datasets:/data:ro")
    monkeypatch.setenv(env.CONTAINER_FLAGS.name, "--writable-tmpfs --env 'A=b c'")
    monkeypatch.setenv(env.CONTAINER_ENV.name, "WANDB_API_KEY, MY_*")
    needed = [tmp_path / "exp" / "logs", tmp_path, "/var/tmp", tmp_path / "exp"]
    made = Container.from_settings(dict(os.environ), runtime="apptainer", command="apptainer", needed=needed)
    assert made.image == str(tmp_path / "exp" / "train.sif")  # named from the submit directory: made absolute
    assert made.binds == (str(tmp_path), "/var/tmp", "/scratch", "/datasets:/data:ro")  # nested ones folded
    assert made.flags == ("--writable-tmpfs", "--env", "A=b c") and made.python == "python3"
    assert made.passed == ("WANDB_API_KEY", "MY_*") and container.podman_env_names(made.passed)[-2:] == [
        "WANDB_API_KEY",
        "MY_*",
    ]
    made.save(tmp_path)
    assert Container.load(tmp_path) == made
    assert Container.load(tmp_path / "exp") is None  # a job without a container


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (env.CONTAINER_MOUNTS.name, "data:/data", "entry 'data:/data' does not start with an absolute path"),
        (env.CONTAINER_FLAGS.name, "--env 'A=b", "cannot be split as a shell would"),
        (env.CONTAINER_FLAGS.name, "--cleanenv", "has --cleanenv, which would take the job's own variables"),
    ],
)
def test_bad_container_settings_are_one_line(name: str, value: str, message: str) -> None:
    settings = {env.CONTAINER.name: "img", name: value}
    with pytest.raises(UserError, match=message):
        Container.from_settings(settings, runtime="apptainer", command="apptainer", needed=["/tmp"])


def test_only_apptainers_flags_that_clear_the_environment_are_refused() -> None:
    for flags in ("-e", "--containall"):
        with pytest.raises(UserError, match=f"has {flags}, which would take"):
            container.parse_flags(flags, "apptainer")
    assert container.parse_flags("-e FOO=1 --shm-size=1g", "podman") == ("-e", "FOO=1", "--shm-size=1g")  # --env


def test_a_runtime_is_found_or_named_as_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    with pytest.raises(UserError, match=r"^no container runtime on gpu1 \(looked for apptainer, singularity"):
        container.find_runtime(None, "img.sif", "gpu1")
    with pytest.raises(UserError, match=r"^container runtime podman not found on gpu1 \(no podman on PATH\)"):
        container.find_runtime("podman", "img", "gpu1")
    with pytest.raises(UserError, match="'docker' is not a container runtime raytrain runs: use one of apptainer"):
        container.find_runtime("docker", "img", "gpu1")
    for tool in ("singularity", "podman"):
        (tmp_path / tool).write_text("#!/bin/sh\n")
        (tmp_path / tool).chmod(0o755)
    # Both installed: the image's form decides (an Apptainer file, else a registry or local name).
    assert container.find_runtime(None, "/shared/img.sif", "gpu1") == ("apptainer", "singularity")
    assert container.find_runtime(None, "localhost/train:1", "gpu1") == ("podman", "podman")
    assert container.find_runtime("apptainer", "docker://ubuntu", "gpu1") == ("apptainer", "singularity")


HOST = {"raytrain": "0.1.0", "ray": "2.60.0"}
SIF = image("apptainer", "apptainer", "/shared/t.sif")


@pytest.mark.parametrize(
    ("answers", "message"),
    [
        ([Answer(node="n1", raytrain="0.1.0", ray="2.60.0", torch="2.9")], None),
        ([], r"^/shared/t.sif \(apptainer\) on n1 gave no answer"),
        ([Answer(node="n1", start_error="FATAL: could not open image")], r"^cannot start .* on n1: FATAL: could not"),
        (
            [Answer(node="n1", no_raytrain="ModuleNotFoundError: No module named 'raytrain'")],
            r"^python3 in /shared/t.sif \(apptainer\) on n1 cannot import raytrain .*install raytrain 0.1.0 in the",
        ),
        (
            [Answer(node="n1", raytrain="0.0.9", ray="2.60.0")],
            r"on n1 has raytrain 0.0.9 with Ray 2.60.0, this host raytrain 0.1.0 with Ray 2.60.0: install the same",
        ),
        (
            [Answer(node="n1", raytrain="0.1.0", ray="2.60.0", no_torch="ImportError: libcudart.so.12")],
            r"^python3 in .* on n1 cannot import torch: ImportError: libcudart.so.12$",
        ),
    ],
)
def test_what_the_check_finds_is_one_line_naming_the_node(answers: list[Answer], message: str | None) -> None:
    if message is None:
        container.judge(SIF, ["n1"], answers, HOST)
        return
    with pytest.raises(UserError, match=message) as caught:
        container.judge(SIF, ["n1"], answers, HOST)
    assert "\n" not in str(caught.value)


def test_several_bad_nodes_are_counted_on_the_first_ones_line() -> None:
    with pytest.raises(UserError, match=r"on n2: boom \(and 1 more node\(s\)\)$"):
        container.judge(
            SIF,
            ["n1", "n2", "n3"],
            [
                Answer(node="n1", raytrain="0.1.0", ray="2.60.0"),
                Answer(node="n2", start_error="boom"),
                Answer(node="n3", start_error="boom"),
            ],
            HOST,
        )


def test_the_check_line_reads_back() -> None:
    answer = Answer(node="n1", raytrain="0.1.0", ray="2.60.0", torch="2.9", python="/usr/bin/python3")
    assert Answer.parse(f"noise\n{container.answer_line(answer)}\n") == [answer]


def test_fit_refuses_a_container_outside_a_submission() -> None:
    out = run_cli("fit", "--container", "img.sif", "--dry-run")
    assert out.returncode == 2 and out.stderr.startswith("raytrain: error: --container runs a Slurm job in IMAGE")
    assert "Traceback" not in out.stderr
    out = run_cli("fit", "--container-runtime", "podman", "--dry-run")
    assert out.returncode == 2 and "--container-runtime picks the runtime for --container IMAGE" in out.stderr


def test_the_container_options_go_to_the_jobs_environment_not_to_its_fit() -> None:
    from raytrain import cli

    typed = ["--slurm", "--container=img.sif", "--container-runtime", "podman", "--epochs=3", "--name", "x"]
    assert cli._forwarded(cli.fit.make_context("fit", typed)) == ["--epochs=3", "--name", "x"]
    typed = ["--container", "img.sif", "--name", "--container", "--slurm"]  # a value that reads like a flag
    assert cli._forwarded(cli.fit.make_context("fit", typed)) == ["--name", "--container"]
