"""Tests of asyncpipe.track: atomic run-dir files, metrics round-trip/truncation, and the W&B mirror."""

from __future__ import annotations

import json
import math
import struct
import time
import warnings
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from asyncpipe.errors import UserError
from asyncpipe.track import RunDir, Tracker, WandbMirror, atomic_write_json, atomic_write_text, resolve_mode, sync
from asyncpipe.track import wandb_mirror
from asyncpipe.track.wandb_mirror import clean_config, derive_tags

SECRET = "fake-secret-123"


def make_cfg(mode: str, **extra) -> OmegaConf:
    cfg = {
        "model": {"name": "tiny"},
        "optimizer": {"name": "adamw", "lr": 1e-3, "ef": {"enabled": True, "lam": 1.0}},
        "tokenizer": {"name": "byte", "vocab_size": 256},
        "delay": 1,
        "engine": "simulate",
        "tracker": {
            "wandb": {"mode": mode, "project": "asyncpipe-test", "entity": None, "group": "g1", "tags": ["t1"]}
        },
    }
    cfg.update(extra)
    return OmegaConf.create(cfg)


@pytest.fixture
def clean_wandb_env(monkeypatch, tmp_path):
    """No credentials and no ambient W&B settings leak into a test."""
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))


def read_wandb_records(path: Path) -> list:
    """Decode a .wandb transaction log (7-byte file header, 32 KiB blocks of crc/len/type-framed records)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, records, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):  # still being written
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a record is complete
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            records.append(rec)
            pending = b""
    return records


def finished_records(run_dir: Path) -> list:
    """The records of the run's single offline .wandb log, once its exit record is there (wandb's service
    process may still be flushing when finish() returns)."""
    (wandb_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 20
    while True:
        records = read_wandb_records(wandb_file)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def test_atomic_writes_leave_no_temp_files(tmp_path):
    atomic_write_text(tmp_path / "a.txt", "hello\n")
    atomic_write_text(tmp_path / "a.txt", "world\n")
    atomic_write_json(tmp_path / "b.json", {"x": float("nan"), "y": [1.5, float("inf")], "p": tmp_path})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.json"]
    assert (tmp_path / "a.txt").read_text() == "world\n"
    assert json.loads((tmp_path / "b.json").read_text()) == {"x": None, "y": [1.5, None], "p": str(tmp_path)}


def test_atomic_write_failure_keeps_old_file_and_no_temp(tmp_path, monkeypatch):
    atomic_write_text(tmp_path / "a.json", "old")

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr("asyncpipe.track.files.os.replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(tmp_path / "a.json", "new")
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]
    assert (tmp_path / "a.json").read_text() == "old"


def test_metrics_roundtrip_nan_as_null_and_summary(tmp_path):
    run = RunDir(tmp_path / "run")
    records = [
        {"step": 1, "tokens": 512, "train_loss": 5.25, "lr": 1e-4, "grad_norm": 0.75},
        {"step": 2, "tokens": 1024, "train_loss": float("nan"), "val_loss": 5.0, "extra": "x"},
    ]
    for r in records:
        run.append_metrics(r)
    got = run.read_metrics()
    assert got[0] == records[0]
    assert got[1] == {**records[1], "train_loss": None}
    assert len(run.metrics_path.read_text().splitlines()) == 2
    run.write_summary({"status": "completed", "final_val_loss": 5.0, "tokens": 1024, "wall_time": float("inf")})
    assert run.read_summary() == {"status": "completed", "final_val_loss": 5.0, "tokens": 1024, "wall_time": None}
    assert RunDir(tmp_path / "other").read_summary() is None


def test_truncate_metrics_drops_later_steps(tmp_path):
    run = RunDir(tmp_path)
    for step in range(1, 8):
        run.append_metrics({"step": step, "train_loss": 10.0 - step})
    assert run.truncate_metrics(after_step=4) == 3
    run.append_metrics({"step": 5, "train_loss": 0.5})
    steps = [r["step"] for r in run.read_metrics()]
    assert steps == [1, 2, 3, 4, 5]
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_interrupted_last_line_is_ignored_and_repaired(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train_loss": 3.0}\n{"step": 2, "trai')
    run = RunDir(tmp_path)
    assert run.read_metrics() == [{"step": 1, "train_loss": 3.0}]
    run.append_metrics({"step": 2, "train_loss": 2.0})
    assert [r["step"] for r in run.read_metrics()] == [1, 2]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(UserError, match="metrics.jsonl:2"):
        run.read_metrics()


def test_config_redacts_api_key(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    run = RunDir(tmp_path)
    run.write_config(f"a: 1\nnote: {SECRET}\n")
    assert SECRET not in run.config_path.read_text()
    assert "a: 1" in run.config_path.read_text()


def test_resolve_mode(clean_wandb_env, monkeypatch, tmp_path):
    assert resolve_mode("disabled") == "disabled"
    assert resolve_mode("offline") == "offline"
    assert resolve_mode("auto") == "offline"
    with pytest.warns(RuntimeWarning, match="no W&B API key"):
        assert resolve_mode("online") == "offline"
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    assert resolve_mode("auto") == "online"
    monkeypatch.setenv("NETRC", str(tmp_path / "missing"))
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    assert resolve_mode("auto") == "online"
    from asyncpipe.config import ConfigError, compose

    with pytest.raises(ConfigError, match="tracker.wandb.mode=sometimes"):
        compose(["tracker.wandb.mode=sometimes"])


def test_clean_config_and_tags(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    service = {"api_key": "x", "hf_token": "y", "Password": "p", "tokens_per_step": 5}
    cfg = make_cfg("offline", service=service, wandb_secret="z", note=f"key={SECRET}")
    clean = clean_config(cfg)
    assert clean["service"] == {"tokens_per_step": 5}
    assert "wandb_secret" not in clean
    assert clean["note"] == "<redacted>"
    assert clean["tokenizer"]["name"] == "byte"  # "tokenizer" is not a secret
    assert clean["optimizer"]["lr"] == 1e-3
    assert derive_tags(cfg) == ["opt:adamw", "delay:1", "model:tiny", "engine:simulate", "ef:on", "t1"]


def test_disabled_and_nonzero_rank_never_call_wandb(clean_wandb_env, tmp_path, monkeypatch):
    import wandb

    calls = []
    monkeypatch.setattr(wandb, "init", lambda *a, **k: calls.append(k))
    for mode, rank in (("disabled", 0), ("offline", 1)):
        tracker = Tracker(make_cfg(mode), tmp_path / f"{mode}{rank}", rank=rank)
        tracker.log({"step": 1, "train_loss": 1.0})
        tracker.finish({"status": "completed"})
    assert calls == []
    assert (tmp_path / "disabled0" / "metrics.jsonl").exists()
    assert not (tmp_path / "offline1").exists()  # other ranks write nothing


def test_wandb_init_failure_warns_once_and_training_goes_on(clean_wandb_env, tmp_path, monkeypatch):
    import wandb

    def broken_init(*args, **kwargs):
        raise RuntimeError("server on fire")

    monkeypatch.setattr(wandb, "init", broken_init)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker = Tracker(make_cfg("offline"), tmp_path, rank=0)
        for step in (1, 2):
            tracker.log({"step": step, "train_loss": 3.0 / step})
        tracker.finish({"status": "completed", "final_val_loss": 1.5, "tokens": 10, "wall_time": 0.1})
    ours = [w for w in caught if "W&B" in str(w.message)]
    assert len(ours) == 1 and "server on fire" in str(ours[0].message)
    assert [r["step"] for r in RunDir(tmp_path).read_metrics()] == [1, 2]
    assert RunDir(tmp_path).read_summary()["status"] == "completed"


def test_wandb_log_failure_disables_mirror(clean_wandb_env, tmp_path, monkeypatch):
    import wandb

    class FlakyRun:
        step, logged = 0, 0

        def log(self, values, step=None):
            FlakyRun.logged += 1
            raise ConnectionError("lost")

        def finish(self, exit_code=0):
            raise AssertionError("a disabled mirror must not call finish")

    monkeypatch.setattr(wandb, "init", lambda **kwargs: FlakyRun())
    with pytest.warns(RuntimeWarning, match="wandb log failed") as caught:
        tracker = Tracker(make_cfg("offline"), tmp_path)
        for step in range(3):
            tracker.log({"step": step, "train_loss": 1.0})
        tracker.finish({"status": "completed"})
    assert FlakyRun.logged == 1 and len(caught) == 1
    assert len(RunDir(tmp_path).read_metrics()) == 3


def test_offline_tracker_writes_wandb_history_and_resume_id(clean_wandb_env, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    tracker = Tracker(make_cfg("offline"), run_dir)
    losses = [4.25, 3.5, 2.875]
    for step, loss in enumerate(losses, start=1):
        tracker.log({"step": step, "tokens": 100 * step, "train_loss": loss})
    tracker.finish({"status": "completed", "final_val_loss": 2.875, "tokens": 300, "wall_time": 1.0})

    run_id = (run_dir / "wandb_id.txt").read_text().strip()
    offline = list((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(offline) == 1
    wandb_file = offline[0] / f"run-{run_id}.wandb"
    assert wandb_file.stat().st_size > 0
    history = {}
    for rec in finished_records(run_dir):
        if rec.WhichOneof("record_type") == "history":
            row = {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item}
            history[rec.history.step.num] = row
    assert [history[s]["train_loss"] for s in (1, 2, 3)] == losses
    assert [history[s]["tokens"] for s in (1, 2, 3)] == [100, 200, 300]
    # A resumed run on the same run dir asks W&B for the same run id.
    import wandb

    seen = {}
    monkeypatch.setattr(wandb, "init", lambda **kwargs: seen.update(kwargs))
    WandbMirror(make_cfg("offline"), run_dir)
    assert (seen["id"], seen["resume"], seen["dir"], seen["group"]) == (run_id, "allow", str(run_dir), "g1")


def test_api_key_never_written_to_run_dir(clean_wandb_env, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    cfg = make_cfg("offline", secrets={"wandb_api_key": SECRET})
    run_dir = tmp_path / "run"
    tracker = Tracker(cfg, run_dir)
    tracker.run.write_config(OmegaConf.to_yaml(cfg))
    tracker.log({"step": 1, "train_loss": 1.0, "val_loss": math.nan})
    tracker.finish({"status": "completed", "final_val_loss": 1.0})
    assert finished_records(run_dir)[-1].WhichOneof("record_type") == "exit"
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files)
    assert len(files) >= 5
    leaks = [p for p in files if SECRET.encode() in p.read_bytes()]
    assert leaks == []


def test_sync(clean_wandb_env, tmp_path, monkeypatch):
    with pytest.raises(UserError, match="no offline W&B runs"):
        sync(tmp_path)
    for run in ("r0", "r1"):
        (tmp_path / run / "wandb" / f"offline-run-20250101_000000-{run}").mkdir(parents=True)
    (tmp_path / "r1" / "wandb" / "run-online-not-synced").mkdir()
    with pytest.raises(UserError, match="no W&B API key"):
        sync(tmp_path)
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    seen = []

    class Done:
        returncode, stdout, stderr = 0, "", ""

    monkeypatch.setattr(wandb_mirror.subprocess, "run", lambda cmd, **kw: seen.append(cmd) or Done())
    lines: list[str] = []
    assert sync(tmp_path, progress=lines.append) == 2
    expected = [str(tmp_path / r / "wandb" / f"offline-run-20250101_000000-{r}") for r in ("r0", "r1")]
    assert [cmd[-2:] for cmd in seen] == [["sync", e] for e in expected]  # one bounded call per run
    assert lines == [f"[1/2] wandb sync {expected[0]}", f"[2/2] wandb sync {expected[1]}"]
    Done.returncode, Done.stderr = 1, "error: api key not configured"
    with pytest.raises(UserError, match="wandb sync failed"):
        sync(tmp_path)


def test_sync_is_bounded_when_wandb_is_unreachable(clean_wandb_env, tmp_path, monkeypatch):
    """A `wandb sync` that would retry for minutes is cut at the timeout and reported in one line."""
    import subprocess

    (tmp_path / "r0" / "wandb" / "offline-run-20250101_000000-r0").mkdir(parents=True)
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    timeouts = []

    def hang(cmd, timeout=None, **kw):
        timeouts.append(timeout)
        raise subprocess.TimeoutExpired(cmd, timeout)

    monkeypatch.setattr(wandb_mirror.subprocess, "run", hang)
    with pytest.raises(UserError, match=r"did not finish in 5 s \(is W&B reachable.*0 of 1 runs were uploaded"):
        sync(tmp_path, timeout_s=5)
    assert timeouts == [5]
    with pytest.raises(UserError, match="must be > 0"):
        sync(tmp_path, timeout_s=0)


def test_train_records_provenance_and_train_log(tmp_path):
    """`asyncpipe train` leaves the overrides as typed, the command line, the code's commit and the library versions
    in provenance.json, and its progress lines in train.log; a resume adds its own start."""
    import os
    import subprocess
    import sys

    run = tmp_path / "run"
    overrides = ["train.steps=2", "train.eval_every=1", "train.log_every=1", f"run.dir={run}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", "asyncpipe", "train", *overrides], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    prov = json.loads((run / "provenance.json").read_text())
    assert prov["overrides"] == overrides and "asyncpipe train train.steps=2" in prov["command"]
    assert prov["versions"]["torch"] and prov["versions"]["hydra-core"] and "wandb" in prov["versions"]
    # the rules it ran, as declared (asyncpipe.registry): a report never pools runs of different revisions
    assert prov["revisions"] == {"optimizer": {"name": "adamw", "revision": 1},
                                 "compensation": {"name": "none", "revision": 1},
                                 "schedule": {"name": "1f1b", "revision": 1}}  # fmt: skip
    repo = Path(__file__).resolve().parents[1]
    if (repo / ".git").exists():
        assert len(prov["git"]["commit"]) == 40 and isinstance(prov["git"]["dirty"], bool)
    log = (run / "train.log").read_text()
    assert "step 1/2" in log and "step 2/2" in log and "completed: final val loss" in log
    bad = subprocess.run([sys.executable, "-m", "asyncpipe", "train", "train.steps=2", f"run.dir={tmp_path / 'x'}",
                          "optimizer.lr=-1"], capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert bad.returncode == 2 and not (tmp_path / "x").exists()  # a refused run leaves no run dir behind


def test_provenance_of_a_launcher_and_its_ranks_is_one_start(tmp_path):
    from asyncpipe.track.provenance import write_provenance

    launcher = {"host": "h", "pid": 10, "ppid": 1, "overrides": ["a=1"]}
    rank0 = {"host": "h", "pid": 11, "ppid": 10, "overrides": ["a=1", "run.dir=x"]}
    write_provenance(tmp_path, rank0)  # the rank wrote first: the launcher's record replaces it
    write_provenance(tmp_path, launcher)
    assert json.loads((tmp_path / "provenance.json").read_text()) == {**launcher, "resumed": []}
    write_provenance(tmp_path, rank0)  # and a rank never overwrites its launcher's
    resume = {"host": "h", "pid": 20, "ppid": 1, "overrides": ["a=1", "resume=true"]}
    write_provenance(tmp_path, resume)
    assert json.loads((tmp_path / "provenance.json").read_text()) == {**launcher, "resumed": [resume]}


def test_offline_writing_is_announced_once_where_it_happens(clean_wandb_env, tmp_path, monkeypatch):
    """Issue 41: a run that writes W&B files offline into its run dir says so (where, how to upload, how to turn it
    off); a disabled one says nothing."""
    import types

    import wandb

    monkeypatch.setattr(wandb, "init", lambda *a, **k: types.SimpleNamespace(step=0, log=lambda *a, **k: None))
    said: list[str] = []
    Tracker(make_cfg("offline"), tmp_path / "off", rank=0, say=said.append)
    assert said == [f"W&B: writing this run offline to {tmp_path / 'off' / 'wandb'} (upload later: asyncpipe sync "
                    f"{tmp_path / 'off'}; tracker.wandb.mode=disabled turns W&B off)"]  # fmt: skip
    Tracker(make_cfg("disabled"), tmp_path / "no", rank=0, say=said.append)
    assert len(said) == 1
