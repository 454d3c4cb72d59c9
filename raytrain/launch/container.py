"""Running a job's processes inside the user's container image: Apptainer, Pyxis (enroot) or Podman.

One setting, ``RAYTRAIN_CONTAINER`` (``raytrain fit --slurm --container IMAGE``), puts every Ray process
of a job (each node's supervisor and all it starts, a lost node's Ray started again), the driver, and what
``raytrain submit`` and ``raytrain status`` run on the head inside IMAGE. The batch script and its helpers
stay on the host: they call Slurm, which an image does not carry. ``setup`` settles the container once
(the runtime found, the directories every process needs), checks it on every node before any Ray starts
(:mod:`raytrain.launch.container_check`) and writes it to the job directory (``CONTAINER``), where every
later process of the job reads it: the job keeps its image even when the login shell's settings change.

Each runtime is called the way its users call it:

- Apptainer: ``apptainer exec [--nv] --bind SRC[:DST],... --pwd DIR IMAGE CMD``; the host's environment,
  network, PID and IPC namespaces (so ``/dev/shm``) are the container's, as Apptainer does by default.
- Pyxis: ``srun --container-image=IMAGE --container-mounts=SRC:DST,... --container-workdir=DIR`` on the
  step itself (enroot's hooks bring in the GPUs; the step's environment passes in).
- Podman: ``podman run --rm --network=host --pid=host --ipc=host [--device nvidia.com/gpu=all] -v ...
  -w DIR --env NAME... IMAGE CMD`` (GPUs through CDI); rootless under ``--userns=keep-id``, so that files on
  the shared filesystem keep the user's ownership. Each container carries the job's label, so that the
  teardown can remove one whose ``podman run`` was killed (conmon outlives it, outside the step).

The token stays a file on every runtime (``RAY_AUTH_TOKEN_PATH``, on a bound directory); no value of any
variable is ever put on a command line: Podman's ``--env NAME`` copies it from the caller.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from dataclasses import replace as dataclass_replace
from pathlib import Path

from raytrain import processes, slurm_env
from raytrain.contracts import env
from raytrain.contracts.jobdir import CONTAINER
from raytrain.errors import UserError

Runtime = env.ContainerRuntime
RUNTIMES = env.CONTAINER_RUNTIMES
PYXIS = slurm_env.SRUN  # Pyxis is options of Slurm's srun, not a command of its own
JOB_LABEL = "raytrain.job"  # podman: every container of a job carries <this>=<job id>
NODE_LABEL = "raytrain.node"  # ... and <this>=<the Slurm node it runs on>
CHECK_STEP = "raytrain-container-check"
# The check starts the image on every node: a first pull or import of a large image takes its time there.
TIMEOUT_HINT = f"an image that takes longer to pull or import: raise {env.JOIN_TIMEOUT.name}"
MARK = f"{env.CONTAINED.name}=1"  # set in every process raytrain starts inside the image
URI_SCHEMES = ("docker://", "docker-daemon://", "library://", "oras://", "shub://", "http://", "https://")

# Pyxis passes every variable of the step, but an image's own value (its ENV) wins over the host's unless
# named in --container-env: these (and every variable of raytrain's table) are, as the host has them.
PYXIS_HOST_WINS = ("RAYTRAIN_*", "RAY_*", "NCCL_*", "GLOO_*")
# Podman passes no variable of the caller's unless told: these (a trailing * is a prefix, as Podman reads
# it) reach every process of a job, beside every variable of raytrain's own table.
PODMAN_ENV = (
    "RAYTRAIN_*",
    "RAY_*",
    *slurm_env.VARIABLES,
    "NCCL_*",
    "GLOO_*",
    "CUDA_*",
    "NVIDIA_*",
    "TORCH*",
    "PYTORCH_*",
    "OMP_*",
    "KMP_*",
    "MKL_*",
    "HOME",
    "USER",
    "LOGNAME",
    "LANG",
    "LC_*",
    "TZ",
    "PYTHONPATH",
    "PYTHONUNBUFFERED",
    "PYTHONDONTWRITEBYTECODE",
    "UCX_*",
    "FI_*",
    "HF_*",
    "WANDB_*",
    "AWS_*",
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "SSL_CERT_FILE",
)
# Apptainer flags that would strip the job's variables (its address, token path, Slurm's) from its processes.
ENV_CLEARING = ("--cleanenv", "-e", "--containall", "-C")


def binary(runtime: Runtime) -> str | None:
    """The runtime's command on this node (Pyxis has none: it is an option of srun)."""
    if runtime == "apptainer":
        return shutil.which("apptainer") or shutil.which("singularity")
    if runtime == "podman":
        return shutil.which("podman")
    return None


def likely_runtimes(image: str) -> tuple[Runtime, ...]:
    """The runtimes to look for, most likely first, by the image's form: an Apptainer image file or
    library URI, an enroot squashfs or ``registry#image``, else a registry or local name."""
    if image.startswith(("library://", "oras://", "shub://")) or image.endswith((".sif", ".simg", ".img")):
        return ("apptainer", "pyxis", "podman")
    if "#" in image or image.endswith((".sqsh", ".squashfs")):
        return ("pyxis", "apptainer", "podman")
    if os.path.isdir(image):  # an Apptainer sandbox
        return ("apptainer", "podman", "pyxis")
    return ("podman", "pyxis", "apptainer")


def find_runtime(asked: str | None, image: str, node: str) -> tuple[Runtime, str]:
    """The runtime to use and its command: the one asked for, else the first found on this node of those
    the image's form suggests."""
    if asked and asked not in RUNTIMES:
        raise UserError(
            f"{env.CONTAINER_RUNTIME.name}={asked!r} is not a container runtime raytrain runs: "
            f"use one of {', '.join(RUNTIMES)}"
        )
    for runtime in [r for r in RUNTIMES if r == asked] if asked else likely_runtimes(image):
        if runtime == "pyxis":
            if slurm_env.srun_takes("--container-image"):
                return runtime, PYXIS
        elif found := binary(runtime):
            return runtime, os.path.basename(found)
    if asked:
        missing = "srun without the Pyxis plugin" if asked == "pyxis" else f"no {asked} on PATH"
        raise UserError(f"container runtime {asked} not found on {node} ({missing}): install it, or pick another")
    raise UserError(
        f"no container runtime on {node} (looked for apptainer, singularity, srun with Pyxis, podman): "
        f"install one, or set {env.CONTAINER_RUNTIME.name}"
    )


def _nested(path: str, others: Sequence[str]) -> bool:
    return any(path != o and (path + "/").startswith(o.rstrip("/") + "/") for o in others)


def default_binds(paths: Sequence[Path | str]) -> tuple[str, ...]:
    """PATHS as binds at the same place inside (absolute, deduplicated, none below another)."""
    absolute = sorted({os.path.abspath(os.path.expanduser(str(p))) for p in paths})
    return tuple(p for p in absolute if p != "/" and not _nested(p, absolute))


def parse_mounts(text: str | None) -> tuple[str, ...]:
    """``SRC[:DST[:OPTS]]`` entries, comma-separated; each source must be an absolute path."""
    mounts = tuple(m.strip() for m in (text or "").split(",") if m.strip())
    for mount in mounts:
        if not mount.split(":", 1)[0].startswith("/"):
            raise UserError(
                f"{env.CONTAINER_MOUNTS.name} entry {mount!r} does not start with an absolute path: "
                "give SRC[:DST[:OPTS]] with SRC absolute, entries separated by commas"
            )
    return mounts


def parse_flags(text: str | None, runtime: Runtime) -> tuple[str, ...]:
    name = env.CONTAINER_FLAGS.name
    try:
        flags = tuple(shlex.split(text or ""))
    except ValueError as exc:
        raise UserError(f"{name} cannot be split as a shell would ({exc}): check its quotes") from None
    if clearing := [f for f in flags if f in ENV_CLEARING and runtime == "apptainer"]:  # Podman's -e is --env
        raise UserError(
            f"{name} has {clearing[0]}, which would take the job's own variables (its address, token file, "
            "Slurm's) from every process in the image: leave it out"
        )
    return flags


@dataclass(frozen=True)
class Container:
    """Where and how a job's processes run: settled once by ``setup``, read from the job directory."""

    image: str
    runtime: Runtime
    command: str  # the runtime's command on the nodes: apptainer, singularity, podman (PYXIS for Pyxis)
    binds: tuple[str, ...]  # SRC[:DST[:OPTS]]: the job's own directories first, then the user's
    flags: tuple[str, ...]  # the user's extra flags for the runtime, as given
    python: str  # the image's interpreter with raytrain installed
    passed: tuple[str, ...] = ()  # the user's variables: Podman passes them, Pyxis lets them win; NAME or PREFIX*

    @classmethod
    def from_settings(
        cls, environ: Mapping[str, str], *, runtime: Runtime, command: str, needed: Sequence[Path | str]
    ) -> Container:
        image = env.CONTAINER.require(environ)
        if not image.startswith(URI_SCHEMES) and os.path.exists(image):
            image = os.path.abspath(image)  # a file or directory named from the submit directory
        passed = tuple(n.strip() for n in (env.CONTAINER_ENV.get(environ) or "").split(",") if n.strip())
        return cls(
            image=image,
            runtime=runtime,
            command=command,
            binds=(*default_binds(needed), *parse_mounts(env.CONTAINER_MOUNTS.get(environ))),
            flags=parse_flags(env.CONTAINER_FLAGS.get(environ), runtime),
            python=env.CONTAINER_PYTHON.require(environ),
            passed=passed,
        )

    def save(self, job_dir: Path) -> None:
        path = job_dir / CONTAINER
        tmp = path.with_name(f".{CONTAINER}.tmp")
        tmp.write_text(json.dumps(asdict(self)))
        tmp.replace(path)

    @classmethod
    def load(cls, job_dir: Path) -> Container | None:
        """The job's container; None for a job that runs on the host."""
        try:
            raw = json.loads((job_dir / CONTAINER).read_text())
        except FileNotFoundError:
            return None
        runtime = next(r for r in RUNTIMES if r == raw["runtime"])
        return cls(
            image=str(raw["image"]),
            runtime=runtime,
            command=str(raw["command"]),
            binds=tuple(raw["binds"]),
            flags=tuple(raw["flags"]),
            python=str(raw["python"]),
            passed=tuple(raw.get("passed", ())),
        )

    def binds_for(self, workdir: str) -> tuple[str, ...]:
        """The binds, and WORKDIR too when none covers it (``raytrain submit`` from another directory: its
        files, and what a relative ``--storage`` writes, must be the host's, not the container's)."""
        same = [p[0] for p in (m.split(":") for m in self.binds) if len(p) == 1 or p[1] == p[0]]
        covered = any(workdir == s or workdir.startswith(s.rstrip("/") + "/") for s in same)
        return self.binds if covered or workdir == "/" else (*self.binds, workdir)

    def srun_options(self, workdir: str, job_id: str, environ: Mapping[str, str] = os.environ) -> list[str]:
        """Pyxis: the srun options that put a step inside the image (none for the other runtimes). Every
        step of the job on a node shares one container (``--container-name``), so the image is imported
        once per node (by the check), not once per step; Pyxis removes it when the job ends. The step
        gets all of ENVIRON, but where the image sets a variable too its value wins unless the variable
        is named in ``--container-env``: those of :func:`pyxis_env_names` are."""
        if self.runtime != "pyxis":
            return []
        mounts = ",".join(_pair(m) for m in self.binds_for(workdir))
        opts = [f"--container-image={self.image}", f"--container-name=raytrain-{job_id}"]
        opts += [f"--container-mounts={mounts}", f"--container-workdir={workdir}", f"--export=ALL,{MARK}"]
        if names := pyxis_env_names(environ, self.passed):
            opts.append(f"--container-env={','.join(names)}")
        return [*opts, *self.flags]

    def run_argv(
        self,
        argv: Sequence[str],
        *,
        workdir: str,
        gpus: Sequence[str],
        name: str,
        job_id: str,
        node: str,
        anchor: int | None = None,
        euid: int | None = None,
    ) -> list[str]:
        """ARGV (its first word a command inside the image) under Apptainer or Podman, as started on the
        node it runs on; GPUS: the node's GPUs for the job (Slurm's indices, or ``all``), none for a CPU
        node; ANCHOR (Podman): the pid that becomes this ``podman run`` (see :func:`anchor`). Pyxis wraps
        the step instead (:meth:`srun_options`): ARGV comes back as it is."""
        if self.runtime == "pyxis":
            return list(argv)
        binds = self.binds_for(workdir)
        if self.runtime == "apptainer":
            cmd = [self.command, "exec", *(["--nv"] if gpus else [])]  # CUDA_VISIBLE_DEVICES passes as is
            cmd += [f"--bind={','.join(binds)}"] if binds else []
            return [*cmd, f"--pwd={workdir}", f"--env={MARK}", *self.flags, self.image, *argv]
        cmd = [self.command, "run", "--rm", f"--name={name}", f"--label={JOB_LABEL}={job_id}"]
        cmd.append(f"--label={NODE_LABEL}={node}")  # a store shared by nodes (a home on NFS) holds others' too
        cmd += ["--network=host", "--pid=host", "--ipc=host", "--security-opt=label=disable"]
        if (os.geteuid() if euid is None else euid) != 0:
            cmd.append("--userns=keep-id")  # rootless: the user inside is the user outside
        if "all" in gpus:
            raise UserError(
                f"Slurm names none of {node}'s GPUs for this step (a count only, no SLURM_STEP_GPUS), and a "
                "Podman container runs outside the step's cgroup, so it would see every GPU of the node: give "
                "the GPUs File= lines in gres.conf, or use Apptainer or Pyxis"
            )
        cmd += [f"--device=nvidia.com/gpu={g}" for g in gpus]
        cmd += [f"--volume={_pair(m)}" for m in binds]
        cmd += [f"--env={n}" for n in podman_env_names(self.passed)]
        if gpus and "all" not in gpus:  # only the job's GPUs are in the container, numbered from 0 there
            cmd.append(f"--env=CUDA_VISIBLE_DEVICES={','.join(str(i) for i in range(len(gpus)))}")
        cmd += [f"--env={MARK}", *([f"--env={env.ANCHOR.name}={anchor}"] if anchor is not None else [])]
        return [*cmd, f"--workdir={workdir}", *self.flags, self.image, *argv]


def _pair(mount: str) -> str:
    """SRC as SRC:SRC (Podman and Pyxis want both sides); SRC:DST[:OPTS] as given."""
    return mount if ":" in mount else f"{mount}:{mount}"


def _matching(patterns: Sequence[str]) -> Callable[[str], bool]:
    """Whether a variable's name is one of PATTERNS: NAME, or PREFIX* as Podman reads it."""
    prefixes = tuple(p[:-1] for p in patterns if p.endswith("*"))
    exact = {p for p in patterns if not p.endswith("*")}
    return lambda name: name in exact or name.startswith(prefixes)


def podman_env_names(passed: Sequence[str] = ()) -> list[str]:
    """PODMAN_ENV, every name of raytrain's table that no pattern there covers, then the user's own."""
    covered = _matching(PODMAN_ENV)
    own = (v.name for v in env.TABLE if not covered(v.name))
    return [*dict.fromkeys([*PODMAN_ENV, *own, *passed])]


def pyxis_env_names(environ: Mapping[str, str], passed: Sequence[str] = ()) -> list[str]:
    """The variables of ENVIRON whose host value must win over an image's own under Pyxis: raytrain's and
    Ray's (the job's contract), NCCL's and Gloo's (the cluster's network, not the image's build), and the
    user's own (NAME or PREFIX*). Pyxis takes names only, so prefixes are matched here."""
    wins = _matching([*PYXIS_HOST_WINS, *(v.name for v in env.TABLE), *passed])
    return sorted(n for n in environ if wins(n))


def gpus_here(environ: Mapping[str, str]) -> list[str]:
    """This node's GPUs for the job, from Slurm: their indices on the node (:func:`slurm_env.gpu_indices`),
    ``all`` when Slurm gives a count only (Apptainer's ``--nv`` then leaves the step's cgroup to confine
    them; Podman refuses it), none on a CPU node."""
    job = slurm_env.current(environ)
    if job is not None and job.gpus_on_node is not None:
        if job.gpus_on_node == 0:
            return []
    else:
        visible = environ.get("CUDA_VISIBLE_DEVICES", "")
        if not visible.strip() or visible == "NoDevFiles":
            return []
    return slurm_env.gpu_indices(environ) or ["all"]


def job_attempt() -> tuple[str, str]:
    """The job's id (every container's label), and the attempt (<id>.<restarts>: names stay unique when
    Slurm requeues the job while a container of the attempt before is still being removed)."""
    job = slurm_env.current()
    return (job.job_id, f"{job.job_id}.{job.restart_count}") if job else ("none", "none")


def anchor(environ: Mapping[str, str] | None = None) -> Callable[[], bool] | None:
    """Inside a Podman container: a check that the ``podman run`` on the host that started it still runs.
    Slurm ends a step by signalling its processes, and SIGKILLs what is left; ``podman run`` passes a
    signal on only while it runs, and its container lives on under conmon, outside the step. So what
    runs inside ends itself once that process is gone (None: not in such a container)."""
    raw = env.ANCHOR.get(environ)
    return processes.alive_check(int(raw)) if raw and raw.isdigit() else None


def inside(environ: Mapping[str, str] | None = None) -> bool:
    """This process runs inside the job's image (raytrain set the mark when it started the container)."""
    return env.CONTAINED.get(environ) == "1"


def step_argv(
    container: Container, job_dir: Path, argv: Sequence[str], *, node: str, step: str, output: Path | None = None
) -> list[str]:
    """srun running ARGV (a command inside the image) as the step STEP on NODE of this job: under Pyxis the
    step itself is the container; under Apptainer and Podman the step runs ``raytrain.launch in-image`` on
    the host there, which starts the container with what that node has (its GPUs, the runtime's path)."""
    job_id, _ = job_attempt()
    if container.runtime == "pyxis":
        extra = container.srun_options(os.getcwd(), job_id)
        return slurm_env.srun_step(node=node, name=step, argv=argv, output=output, extra=extra)
    helper = [env.PYTHON.require(), "-m", "raytrain.launch", "in-image", "--job-dir", str(job_dir)]
    return slurm_env.srun_step(node=node, name=step, argv=[*helper, "--step", step, "--", *argv], output=output)


def here(container: Container, argv: Sequence[str], *, step: str) -> list[str]:
    """What runs ARGV inside the image on this node, from this process: Apptainer and Podman directly
    (the container named after STEP, this node and this process); Pyxis as a step of its own here, named
    STEP (srun, nested in the current step if any)."""
    node = slurm_env.node_name()
    job_id, attempt = job_attempt()
    if container.runtime == "pyxis":
        extra = container.srun_options(os.getcwd(), job_id)
        return slurm_env.srun_step(node=node, name=step, argv=argv, extra=extra)
    if shutil.which(container.command) is None:
        raise UserError(f"{container.command} not found on {node}: install {container.runtime} there")
    name = f"raytrain-{attempt}-{step}-{node}-{os.getpid()}"
    gpus = gpus_here(os.environ)
    # This process becomes the podman run (exec), or waits on it: the container's anchor either way.
    return container.run_argv(
        argv, workdir=os.getcwd(), gpus=gpus, name=name, job_id=job_id, node=node, anchor=os.getpid()
    )


# --- the check before anything starts ------------------------------------------------------------------
# Run by the image's interpreter on every node: what it has, as one line the host reads back.
CHECK_MARK = "raytrain-container-check:"
_CHECK = f"""
import json, os, socket, sys
out = {{"node": os.environ.get({slurm_env.NODE_NAME!r}) or socket.gethostname(), "python": sys.executable}}
try:
    from importlib.metadata import version
    import raytrain, ray
    out["raytrain"], out["ray"] = version("raytrain"), ray.__version__
except Exception as exc:
    out["no_raytrain"] = f"{{type(exc).__name__}}: {{exc}}"
try:
    import torch
    out["torch"] = torch.__version__
except Exception as exc:
    out["no_torch"] = f"{{type(exc).__name__}}: {{exc}}"
print({CHECK_MARK!r}, json.dumps(out), flush=True)
"""


@dataclass(frozen=True)
class Answer:
    """What one node's check found: the image's versions, or why it could not start or import."""

    node: str
    raytrain: str | None = None
    ray: str | None = None
    torch: str | None = None
    python: str | None = None
    no_raytrain: str | None = None
    no_torch: str | None = None
    start_error: str | None = None  # the container did not start (runtime missing, image not found)

    @classmethod
    def parse(cls, text: str) -> list[Answer]:
        found = []
        for line in text.splitlines():
            if CHECK_MARK in line:
                raw = json.loads(line.split(CHECK_MARK, 1)[1])
                found.append(cls(**{k: v for k, v in raw.items() if k in cls.__dataclass_fields__}))
        return found


def check_argv(image: Container) -> list[str]:
    """The check, as a command in the image."""
    return [image.python, "-c", _CHECK]


def check_here(image: Container, timeout_s: float) -> Answer:
    """On this node (Apptainer, Podman): start the image and run the check, bounded."""
    node = slurm_env.node_name()
    if shutil.which(image.command) is None:
        return Answer(node=node, start_error=f"{image.runtime} not found ({image.command} is not on PATH)")
    argv = here(image, check_argv(image), step="check")
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Answer(node=node, start_error=f"no answer within {timeout_s:.0f} s ({TIMEOUT_HINT})")
    answers = Answer.parse(proc.stdout)
    if answers:
        return dataclass_replace(answers[0], node=node)
    said = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
    return Answer(node=node, start_error=said[-1] if said else f"exit status {proc.returncode}")


def judge(image: Container, nodes: Sequence[str], answers: Sequence[Answer], host: Mapping[str, str]) -> None:
    """A UserError, one line naming the first node, for the first thing wrong; HOST: raytrain's and Ray's
    versions on this host, which the image must match (the batch script's helpers talk to its Ray)."""
    by_node = {a.node: a for a in answers}
    problems: list[str] = []
    for node in nodes:
        answer = by_node.get(node)
        where = f"{image.image} ({image.runtime}) on {node}"
        if answer is None:
            problems.append(f"{where} gave no answer: see the job's log for what the runtime said ({TIMEOUT_HINT})")
        elif answer.start_error:
            problems.append(f"cannot start {where}: {answer.start_error}")
        elif answer.no_raytrain:
            problems.append(
                f"{image.python} in {where} cannot import raytrain ({answer.no_raytrain}): install raytrain "
                f"{host['raytrain']} in the image, or set {env.CONTAINER_PYTHON.name} to the interpreter that has it"
            )
        elif (answer.raytrain, answer.ray) != (host["raytrain"], host["ray"]):
            problems.append(
                f"{where} has raytrain {answer.raytrain} with Ray {answer.ray}, this host raytrain {host['raytrain']} "
                f"with Ray {host['ray']}: install the same versions in both (the job's helpers talk to the image's Ray)"
            )
        elif answer.no_torch:
            problems.append(f"{image.python} in {where} cannot import torch: {answer.no_torch}")
    if problems:
        more = f" (and {len(problems) - 1} more node(s))" if len(problems) > 1 else ""
        raise UserError(problems[0] + more)


def check_nodes(image: Container, nodes: Sequence[str], job_dir: Path, timeout_s: float) -> None:
    """Start the image on every node at once (one step) and judge what each found."""
    from importlib.metadata import version

    if image.runtime == "pyxis":
        job_id, _ = job_attempt()
        extra = image.srun_options(os.getcwd(), job_id)
        argv = slurm_env.srun_on_each(nodes, name=CHECK_STEP, argv=check_argv(image), extra=extra)
    else:
        helper = [env.PYTHON.require(), "-m", "raytrain.launch", "container-check", "--job-dir", str(job_dir)]
        argv = slurm_env.srun_on_each(nodes, name=CHECK_STEP, argv=[*helper, "--timeout", str(timeout_s)])
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s + 15, stdin=subprocess.DEVNULL)
        out, err = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        out, err = _text(exc.stdout), _text(exc.stderr)
    if err.strip():
        print(err.rstrip(), file=sys.stderr)  # what the runtime said, for the job's log
    host = {"raytrain": version("raytrain"), "ray": version("ray")}
    judge(image, nodes, Answer.parse(out), host)


def _text(raw: bytes | str | None) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else (raw or "")


def answer_line(answer: Answer) -> str:
    return f"{CHECK_MARK} {json.dumps(asdict(answer))}"


def settle(nodes: Sequence[str], job_dir: Path, log_root: Path, submit_dir: Path) -> Container:
    """The job's container from the settings (runtime found on this node, the job's directories bound),
    written to the job directory and checked on every node: a UserError naming a node otherwise."""
    runtime, command = find_runtime(env.CONTAINER_RUNTIME.get(), env.CONTAINER.require(), slurm_env.node_name())
    needed: list[Path | str] = [Path.home(), submit_dir, job_dir, log_root, env.TMPDIR.require()]
    image = Container.from_settings(os.environ, runtime=runtime, command=command, needed=needed)
    image.save(job_dir)
    check_nodes(image, nodes, job_dir, env.JOIN_TIMEOUT.value())
    return image


def remove_left(job_id: str, prefix: str = "raytrain-", timeout_s: float = 5.0) -> list[str]:
    """Podman: remove the job's containers on this node whose names start with PREFIX (a ``podman run``
    killed before its container ended leaves it running under conmon, outside the step). Each Podman call
    is bounded; the names of those removed."""
    podman = shutil.which("podman")
    if podman is None:
        return []
    labels = [f"--filter=label={JOB_LABEL}={job_id}", f"--filter=label={NODE_LABEL}={slurm_env.node_name()}"]
    try:
        listed = subprocess.run(
            [podman, "ps", "--all", *labels, "--format", "{{.Names}}"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        names = [n for n in listed.stdout.split() if n.startswith(prefix)]
        if names:
            subprocess.run([podman, "rm", "--force", "--time=0", *names], capture_output=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError):
        return []
    return names
