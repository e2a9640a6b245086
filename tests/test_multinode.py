"""Multi-node `fp4lightning train` over two real hosts: two network namespaces joined by a veth pair
(benchmarks/hosts.py), 2 processes each, world size 4 on gloo.

One module-scoped launch with torchrun (the command docs/distributed.md shows, one launcher per host),
then the run resumed with SLURM's variables set by hand (what srun sets; one process per rank), during
which every process of host 1 is killed, then the surviving host resumes alone on 2 ranks. Checked:
the 4 ranks hold bit-identical weights after every step, each checkpoint is written by one process,
the survivors exit within the stated time with one line naming the lost ranks and host and the last
checkpoint, and both resumes continue at the checkpoint's step.

The ranks are observed, not changed: a ``sitecustomize`` on their PYTHONPATH adds a callback that
records a hash of the weights after each step, and records which process writes each checkpoint.

Those two tests need root and ``ip netns`` (skipped otherwise, with the reason; marker ``multinode``).
The first ones check, without processes, how a lost host and a timed-out collective are told.
"""
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import hosts  # noqa: E402

REASON = hosts.unavailable_reason()

def two_hosts(test):
    """The marks of a test that runs ranks on the two hosts."""
    for mark in (pytest.mark.multinode, pytest.mark.slow,
                 pytest.mark.skipif(REASON is not None, reason=f"two-host harness: {REASON}")):
        test = mark(test)
    return test


BIN = Path(sys.executable).parent
#: a whole launch (imports, rendezvous, a few steps) may take this long on a loaded 2-core machine
LAUNCH_TIMEOUT_S = 300
#: the process-group timeout the runs set (FP4LIGHTNING_DIST_TIMEOUT), and the stated bound on how long
#: the survivors of a dead host take to exit
PG_TIMEOUT_S = 30
SURVIVOR_EXIT_S = 60
PORT = 29500
JOB_ID = "4242"  # SLURM_JOB_ID: Lightning's SLURMEnvironment takes port 15000 + its last 4 digits

_OBSERVER = textwrap.dedent('''
    """Loaded by every Python process of the test's ranks: records weights and checkpoint writes."""
    import importlib.abc, importlib.util, os, sys

    OBS = os.environ.get("FP4_TEST_OBSERVE")


    def _patch(run):
        import hashlib
        import lightning as L
        import torch
        from fp4lightning.train import checkpoint

        class WeightHash(L.Callback):
            # after each optimizer step (not each accumulated micro-batch)
            def on_train_start(self, trainer, pl_module):
                self.step = trainer.global_step

            def on_train_batch_end(self, trainer, pl_module, *args):
                if trainer.global_step == self.step:
                    return
                self.step = trainer.global_step
                h = hashlib.sha256()
                for k, v in sorted(pl_module.state_dict().items()):
                    h.update(k.encode())
                    h.update(v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
                with open(os.path.join(OBS, f"hash.{trainer.global_rank}"), "a") as f:
                    f.write(f"{trainer.global_step} {h.hexdigest()}\\n")

        build = run.build

        def observed_build(cfg, resume=False, callbacks=None, *args, **kwargs):
            return build(cfg, resume, [*(callbacks or []), WeightHash()], *args, **kwargs)

        run.build = observed_build
        save = checkpoint.AtomicCheckpointIO.save_checkpoint

        def observed_save(self, ckpt, path, *args, **kwargs):
            rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "?"))
            with open(os.path.join(OBS, "saves"), "a") as f:
                f.write(f"{rank} {os.getpid()} {path}\\n")
            return save(self, ckpt, path, *args, **kwargs)

        checkpoint.AtomicCheckpointIO.save_checkpoint = observed_save


    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "fp4lightning.train.run":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run_module = spec.loader.exec_module

            def exec_module(module):
                run_module(module)
                _patch(module)

            spec.loader.exec_module = exec_module
            return spec


    if OBS:
        sys.meta_path.insert(0, _Hook())
''')


# gloo's errors as the survivors of a killed host and of a cut link saw them (torch 2.13)
RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [10.47.0.2]:49792: "
         "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application.")
TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
           "15000ms for recv operation to complete")


def test_a_lost_host_is_named_by_its_ranks():
    from fp4lightning.train.peers import lost_host, timed_out

    two_hosts_one_name = [("10.47.0.1", "vm")] * 2 + [("10.47.0.2", "vm")] * 2
    err = RuntimeError(RESET)
    assert lost_host(err, two_hosts_one_name, 0) == "ranks 2, 3 (host 10.47.0.2)"
    named = [("10.0.0.1", "node0"), ("10.0.0.1", "node0"), ("10.47.0.2", "node1"), ("10.47.0.2", "node1")]
    assert lost_host(err, named, 1) == "ranks 2, 3 (host node1)"
    try:  # found through the exception raised while handling gloo's
        try:
            raise err
        except RuntimeError:
            raise ValueError("while saving")
    except ValueError as wrapped:
        assert lost_host(wrapped, named, 0) == "ranks 2, 3 (host node1)"
    # this host's own address names no one rank (one host, loopback): the caller falls back
    assert lost_host(err, [("10.47.0.2", "vm")] * 4, 0) is None
    assert lost_host(RuntimeError("Connection reset by peer"), named, 0) is None  # no address
    assert lost_host(err, [], 0) is None  # no table (one process, or the gather never ran)
    assert timed_out(RuntimeError(TIMEOUT)) and not timed_out(err) and not timed_out(ValueError(TIMEOUT))


def test_a_survivor_that_saw_only_its_neighbour_leave_hears_the_lost_host(tmp_path):
    """The first survivor to name the lost host leaves its words in the process group's store; a
    survivor on its host may see only that rank's socket close (its own host's address, no one named)
    and takes them from there. Nothing left: None after the wait; no process group: None at once."""
    import torch.distributed as dist

    from fp4lightning.train.peers import heard_lost_host, tell_lost_host

    assert heard_lost_host(0.1) is None and tell_lost_host("x") is None  # no group
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert heard_lost_host(0.2) is None
        tell_lost_host("ranks 2, 3 (host 10.47.0.2)")
        assert heard_lost_host(0.2) == "ranks 2, 3 (host 10.47.0.2)"
    finally:
        dist.destroy_process_group()


def test_process_group_timeout_from_the_environment(monkeypatch):
    from datetime import timedelta

    from fp4lightning.errors import UsageError
    from fp4lightning.train.peers import TIMEOUT_ENV, process_group_timeout
    from fp4lightning.train.recipe import load_recipe
    from fp4lightning.train.run import make_strategy

    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert process_group_timeout() is None
    monkeypatch.setenv(TIMEOUT_ENV, "45")
    assert process_group_timeout() == timedelta(seconds=45)
    for overrides in (["trainer.precision=fp4"], ["trainer.precision=bf16-mixed"],
                      ["trainer.strategy=fsdp", "trainer.precision=bf16-mixed"]):
        cfg = load_recipe(None, ["trainer.devices=2", "trainer.num_nodes=2", "trainer.accelerator=cpu",
                                 "data.micro_batch_size=4", *overrides])
        assert make_strategy(cfg)._timeout == timedelta(seconds=45), overrides
    for bad in ("soon", "0", "-3"):
        monkeypatch.setenv(TIMEOUT_ENV, bad)
        with pytest.raises(UsageError, match=f"{TIMEOUT_ENV}=") as e:
            process_group_timeout()
        assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from tests.test_data import prepared_test_corpus

    return prepared_test_corpus(tmp_path_factory)


def _documented(prefix: str) -> tuple:
    """(command, exported variables) of the line starting with ``prefix`` in docs/distributed.md's
    "Multi-node" section (continuation lines joined) and of the ``export`` line of its code block."""
    text = (ROOT / "docs" / "distributed.md").read_text()
    section = text.split("\n## Multi-node\n", 1)[1].split("\n## ", 1)[0]
    for block in section.split("```")[1::2]:
        lines = block.replace("\\\n", " ").splitlines()
        command = next((l.strip() for l in lines if l.strip().startswith(prefix)), None)
        if command is None:
            continue
        exported = {}
        for line in lines:
            if line.startswith("export "):
                exported.update(w.split("=", 1) for w in shlex.split(line.split("#")[0])[1:])
        return shlex.split(command), exported
    raise AssertionError(f"docs/distributed.md, Multi-node: no command starting with {prefix!r}")


def _train_args(documented: list, corpus: Path, out: Path, *extra: str) -> list:
    """The documented ``fp4lightning train`` overrides, then the test's small model, corpus and run folder
    for every key the documented command leaves to the recipe, then ``extra``, then the documented flags."""
    from tests.test_train import tiny_overrides

    args = documented[documented.index("train") + 1:]
    keys = {a.split("=")[0] for a in args if "=" in a}
    mine = [o for o in tiny_overrides(corpus, out, "trainer.checkpoint_every_n_steps=2",
                                      "trainer.val_every_n_steps=1000", "trainer.loggers=csv")
            if o.split("=")[0] not in keys]
    flags = [a for a in args if a.startswith("--")]  # after every override: they are one positional list
    return [*(a for a in args if a not in flags), *mine, *extra, *flags]


def _env(h, obs: Path, exported: dict) -> dict:
    """The test's environment without any launcher's variables, plus the documented exports."""
    leaked = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
              "MASTER_PORT")
    env = {k: v for k, v in os.environ.items()
           if k not in leaked and not k.startswith(("PL_", "TORCHELASTIC", "SLURM_"))}
    obs.mkdir(parents=True, exist_ok=True)
    (obs / "sitecustomize.py").write_text(_OBSERVER)
    assert exported.get("GLOO_SOCKET_IFNAME") == h.ifname, exported
    assert float(exported["FP4LIGHTNING_DIST_TIMEOUT"]) <= SURVIVOR_EXIT_S, exported
    env.update(exported, OMP_NUM_THREADS="1", FP4_TEST_OBSERVE=str(obs), PYTHONPATH=f"{obs}{os.pathsep}{ROOT}",
               PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    return env


def _torchrun(h, node: int, corpus: Path, out: Path, *extra: str) -> tuple:
    """(command, exports) of the documented torchrun line for host ``node``."""
    documented, exported = _documented("torchrun ")
    cmd = [{"$NODE_RANK": str(node), "$HOST0:29500": f"{h.addr(0)}:{PORT}"}.get(a, a) for a in documented]
    cut = cmd.index("--no-python")
    # both namespaces share one host name, which on a real cluster tells torchrun which node hosts the
    # rendezvous and which address the others reach it at
    local = ["--local-addr", h.addr(node), "--rdzv-conf", f"is_host={int(node == 0)}"]
    return ([str(BIN / "torchrun"), *cmd[1:cut], *local, *cmd[cut:cmd.index("train") + 1],
             *_train_args(documented, corpus, out, *extra)], exported)


def _srun(corpus: Path, out: Path, *extra: str) -> tuple:
    """(command, exports) of the documented sbatch script's ``srun`` line, without ``srun``."""
    documented, exported = _documented("srun ")
    assert documented[1:3] == ["fp4lightning", "train"], documented
    return [str(BIN / "fp4lightning"), "train", *_train_args(documented, corpus, out, *extra)], exported


def _slurm_env(h, env: dict, rank: int, ntasks: int = 4, nnodes: int = 2) -> dict:
    """The variables srun sets for task ``rank`` of ``ntasks`` over ``nnodes`` (2 per node), as Lightning's
    SLURMEnvironment reads them; the node list holds addresses where a cluster has host names."""
    return dict(env, SLURM_NTASKS=str(ntasks), SLURM_NTASKS_PER_NODE="2", SLURM_NNODES=str(nnodes),
                SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % 2), SLURM_NODEID=str(rank // 2),
                SLURM_NODELIST=",".join(h.addr(i) for i in range(nnodes)), SLURM_JOB_ID=JOB_ID,
                SLURM_JOB_NAME="fp4-multinode")


def _wait_all(procs: list, logs: list, timeout: float = LAUNCH_TIMEOUT_S) -> list:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            pytest.fail(f"a launch ran past {timeout} s\n{_tails(logs)}")
    return codes


def _tails(logs: list, n: int = 3000) -> str:
    return "\n".join(f"--- {p} ---\n{Path(p).read_text(errors='replace')[-n:]}" for p in logs if Path(p).exists())


def _hashes(obs: Path) -> dict:
    """{rank: {step: weight hash}} from the observer's files."""
    out = {}
    for f in obs.glob("hash.*"):
        out[int(f.suffix[1:])] = dict(line.split() for line in f.read_text().splitlines())
    return out


def _assert_identical(obs: Path, ranks: int, logs: list) -> dict:
    hashes = _hashes(obs)
    assert sorted(hashes) == list(range(ranks)), f"ranks that recorded weights: {sorted(hashes)}\n{_tails(logs)}"
    common = set.intersection(*(set(h) for h in hashes.values()))
    assert common, hashes
    for step in common:
        assert len({hashes[r][step] for r in hashes}) == 1, f"step {step}: ranks differ: {hashes}"
    return hashes


def _saves(obs: Path) -> list:
    path = obs / "saves"
    return [line.split(maxsplit=2) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def torchrun_run(corpus, tmp_path_factory):
    """2 steps on 2 hosts x 2 processes, launched by one torchrun per host; (out_dir, obs, logs, seconds)."""
    base = tmp_path_factory.mktemp("multinode")
    out, obs = base / "run", base / "obs1"
    t0 = time.monotonic()
    with hosts.TwoHosts(rate="1gbit") as h:
        logs = [base / f"torchrun{i}.log" for i in (0, 1)]
        procs = []
        for i in (0, 1):
            cmd, exported = _torchrun(h, i, corpus, out, "schedule.max_steps=2")
            procs.append(h.popen(i, cmd, env=_env(h, obs, exported), stdout=open(logs[i], "w"),
                                 stderr=subprocess.STDOUT, cwd=ROOT))
        codes = _wait_all(procs, logs)
    assert codes == [0, 0], _tails(logs)
    return out, obs, logs, time.monotonic() - t0


@two_hosts
def test_torchrun_on_two_hosts_trains_identical_ranks_and_writes_each_checkpoint_once(torchrun_run):
    out, obs, logs, seconds = torchrun_run
    hashes = _assert_identical(obs, 4, logs)
    assert set(hashes[0]) == {"1", "2"}
    text = logs[0].read_text()
    assert "Starting with 4 processes" in text and "finished after 2 steps" in text, _tails(logs)
    # every checkpoint write came from one process, global rank 0 (the end-of-run save rewrites last.ckpt
    # in that same process); the other host's processes wrote none into the shared folder
    saves = _saves(obs)
    assert saves and {(rank, pid) for rank, pid, _ in saves} == {("0", saves[0][1])}, saves
    assert (out / "checkpoints" / "last.ckpt").is_file() and all(Path(p).parent == out / "checkpoints"
                                                                   for _, _, p in saves), saves
    print(f"torchrun launch on 2 hosts: {seconds:.1f} s")


@two_hosts
def test_slurm_resume_then_a_host_dies_then_the_survivor_resumes_alone(torchrun_run, corpus, tmp_path):
    first, _, _, _ = torchrun_run
    out = tmp_path / "run"
    shutil.copytree(first, out)
    obs, obs_alone = tmp_path / "obs2", tmp_path / "obs3"
    cmd, exported = _srun(corpus, out, "schedule.max_steps=1000")
    assert "--resume" in cmd, cmd
    logs = [tmp_path / f"rank{r}.log" for r in range(4)]
    with hosts.TwoHosts(rate="1gbit") as h:
        env = _env(h, obs, exported)
        procs = [h.popen(r // 2, cmd, env=_slurm_env(h, env, r), stdout=open(logs[r], "w"),
                         stderr=subprocess.STDOUT, cwd=ROOT) for r in range(4)]
        _wait_for_line(logs[0], "step 4/", procs, logs)
        killed_at = time.monotonic()
        h.kill_host(1)  # every process of host 1: ranks 2 and 3
        codes = _wait_all(procs[:2], logs, timeout=SURVIVOR_EXIT_S + 30)
        took = time.monotonic() - killed_at
        _wait_all(procs[2:], logs)
    assert took <= SURVIVOR_EXIT_S, f"survivors took {took:.0f} s to exit\n{_tails(logs)}"
    text = logs[0].read_text()
    assert "resuming from" in text and "step 3/1000" in text, _tails(logs)  # continued at the checkpoint
    _assert_identical(obs, 4, logs)
    ckpt = None
    for r in (0, 1):
        lines = [l for l in logs[r].read_text().splitlines() if l.startswith("fp4lightning train: error:")]
        assert codes[r] == 2 and len(lines) == 1, _tails(logs)
        assert f"ranks 2, 3 (host {h.addr(1)}) of 4 stopped" in lines[0], lines[0]
        assert "last checkpoint " in lines[0] and "--resume" in lines[0], lines[0]
        ckpt = lines[0].split("last checkpoint ")[1].split(" (")[0]
    assert Path(ckpt).exists(), ckpt
    print(f"survivors exited {took:.1f} s after host 1 was killed: {lines[0]}")

    # the surviving host alone: world size 2, the same global batch (2 micro-batches accumulated per step)
    import torch

    step = torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"]
    cmd, exported = _srun(corpus, out, "schedule.max_steps=6", "trainer.num_nodes=1")
    logs3 = [tmp_path / f"alone{r}.log" for r in range(2)]
    with hosts.TwoHosts(rate="1gbit") as h:
        env = _env(h, obs_alone, exported)
        procs = [h.popen(0, cmd, env=_slurm_env(h, env, r, ntasks=2, nnodes=1), stdout=open(logs3[r], "w"),
                         stderr=subprocess.STDOUT, cwd=ROOT) for r in range(2)]
        codes = _wait_all(procs, logs3)
    assert codes == [0, 0], _tails(logs3)
    text = logs3[0].read_text()
    assert "finished after 6 steps" in text, _tails(logs3)
    hashes = _assert_identical(obs_alone, 2, logs3)
    assert min(map(int, hashes[0])) == step + 1, (step, hashes)  # the first step after the checkpoint's


def _wait_for_line(log: Path, prefix: str, procs: list, logs: list, timeout: float = LAUNCH_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and any(line.startswith(prefix) for line in log.read_text(errors="replace").splitlines()):
            return
        if any(p.poll() is not None for p in procs):
            pytest.fail(f"a rank exited before {prefix!r}\n{_tails(logs)}")
        time.sleep(0.2)
    pytest.fail(f"no {prefix!r} within {timeout} s\n{_tails(logs)}")
