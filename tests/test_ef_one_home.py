"""grep-level: EF's rule has one home (asyncpipe/optim/compensation/ef.py; its torch-free declaration:
asyncpipe/compensation/ef.py, which also declares its label, run-dir tag, the *_ef presets' switch `optimizer.ef.*`
and its checkpoint fingerprint key); the switch is named only in that declaration or where old records are read
(report/load, report/groups, describe's key list, the bench's refused keys); and the config, the registry and the
checkpoints read all of it from the declaration, naming EF nowhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "asyncpipe"
EF_HOME = "optim/compensation/ef.py"
EF_DECLARATION = "compensation/ef.py"  # its settings and their check
# Where the switch may still be named in code (not comments/docstrings): its declaration (lam's check names it), its
# key list for `config show`, reading records written before it became an alias, the bench's list of keys its
# variants set.
SWITCH_READERS = {EF_DECLARATION, "config/describe.py", "report/load.py", "report/groups.py", "bench/simulator.py"}
# Modules that read what a method declares (its switch, label, tag, fingerprint key) and so never name one.
GENERIC = ["config/schema.py", "config/alias.py", "config/validate.py", "registry.py", "runtime/checkpoint.py"]


def _code(path: Path) -> str:
    """The module's code without comments and docstrings (a rough cut: lines inside triple quotes dropped)."""
    out, in_doc = [], False
    for line in path.read_text().splitlines():
        quotes = line.count('"""')
        if in_doc or quotes:
            if quotes == 1:
                in_doc = not in_doc
            continue
        out.append(line.split("#", 1)[0])
    return "\n".join(out)


def _modules() -> dict[str, str]:
    return {str(p.relative_to(PKG)): _code(p) for p in PKG.rglob("*.py")}


def test_the_ef_rule_exists_in_one_module() -> None:
    modules = _modules()
    assert not (PKG / "optim" / "ef.py").exists()
    # The rule x(t+1) = x(t) - u(t) - lam (u(t) - u(t-1)): the class that applies it, and its arithmetic (the
    # correction lam (u(t-1) - u(t)) formed from the stored u(t-1) and added to the parameter).
    defined = [name for name, code in modules.items() if re.search(r"^class ErrorFeedback\b", code, re.M)]
    assert defined == [EF_HOME]
    arithmetic = [name for name, code in modules.items() if re.search(r"\.sub_\(u\)\.mul_\(lam\)", code)]
    assert arithmetic == [EF_HOME]
    # Every other module that builds EF goes through the registry's method `ef`, never the class itself.
    users = [name for name, code in modules.items() if "ErrorFeedback(" in code and name != EF_HOME]
    assert users == []


def test_the_ef_switch_is_read_only_where_it_is_resolved() -> None:
    readers = {name for name, code in _modules().items()
               if re.search(r"(optimizer|o|cfg)\.ef\.(enabled|lam)|optimizer\.ef\.", code)}
    assert readers <= SWITCH_READERS, readers - SWITCH_READERS
    declared = {name for name, code in _modules().items() if re.search(r"\bSwitch\(\s*\"ef\"", code)}
    assert declared == {EF_DECLARATION}


def test_the_config_the_registry_and_checkpoints_name_no_method() -> None:
    """Whatever EF needs outside its modules is declared in asyncpipe/compensation/ef.py and read generically."""
    modules = _modules()
    named = {
        name: re.findall(r"(?i)\bef\b|\w+_ef\b|\berror.?feedback", modules[name])
        for name in GENERIC
        if re.search(r"(?i)\bef\b|\w+_ef\b|\berror.?feedback", modules[name])
    }
    assert named == {}


def test_the_declared_switch_resolves_into_its_method() -> None:
    """optimizer.ef.enabled=true, read from the declaration, is compensation=ef with the switch's lambda, constant;
    the switch is reset to its declared defaults; a record keeps another method, a composed config refuses both."""
    from omegaconf import OmegaConf

    from asyncpipe.config.alias import resolve_switch, switched_on
    from asyncpipe.errors import ConfigError

    record = {"optimizer": {"name": "adamw", "ef": {"enabled": "true", "lam": 0.25}}, "compensation": {"name": "none"}}
    assert switched_on(record).name == "ef"
    resolve_switch(record)
    assert record["compensation"] == {"name": "ef", "ef": {"lam": 0.25, "schedule": "constant", "warmup_steps": 0}}
    assert record["optimizer"]["ef"] == {"enabled": False, "lam": 1.0} and switched_on(record) is None
    other = {"optimizer": {"ef": {"enabled": True, "lam": 0.5}}, "compensation": {"name": "dc"}}
    assert resolve_switch(other, strict=False)["compensation"] == {"name": "dc"}
    refused = r"optimizer.ef.enabled=true \(the \*_ef presets\) and compensation=dc: choose one"
    with pytest.raises(ConfigError, match=refused):
        resolve_switch(OmegaConf.create(other))


def test_runs_recorded_with_the_switch_still_resume() -> None:
    """A run started before the switch became an alias recorded optimizer.ef.enabled=true and compensation=none in
    config.yaml and {"ef": true} (no "compensation") in its checkpoints' fingerprint; resuming it under the alias
    changes no setting and matches the fingerprint. EF's checkpoint layout is unchanged (test_optim_ef)."""
    import copy

    from omegaconf import OmegaConf

    from asyncpipe.config import compose
    from asyncpipe.runtime.checkpoint import fingerprint_of
    from asyncpipe.session.rundir import changed_settings

    cfg = compose(["optimizer=adamw_ef", "delay=1", "optimizer.ef.lam=0.5", "run.dir=runs/x"])
    assert cfg.compensation.name == "ef" and cfg.compensation.ef.lam == 0.5
    old = OmegaConf.to_container(cfg, resolve=True)
    old["optimizer"]["ef"] = {"enabled": True, "lam": 0.5}
    old["compensation"]["name"] = "none"
    old["compensation"]["ef"] = {"lam": 1.0, "schedule": "constant", "warmup_steps": 0}
    assert changed_settings(copy.deepcopy(old), cfg) == []
    other = copy.deepcopy(old)
    other["optimizer"]["ef"]["lam"] = 0.7  # a different lambda is a change
    assert [k for k, _, _ in changed_settings(other, cfg)] == ["compensation.ef.lam"]
    fp = fingerprint_of(cfg)
    assert fp["ef"] is True and "compensation" not in fp  # what the *_ef presets' checkpoints always carried


def _checkpoint_with(tmp_path: Path, fp: dict) -> Path:
    import json

    import torch

    from asyncpipe.runtime import checkpoint

    step = tmp_path / "step_00000004"
    step.mkdir()
    marker = {"format": checkpoint.FORMAT, "step": 4, "world": 1, "fingerprint": fp}
    (step / checkpoint.MARKER).write_text(json.dumps(marker))
    torch.save({"format": checkpoint.FORMAT, "fingerprint": fp, "state": {"x": 1}}, step / "rank0.pt")
    return step


@pytest.mark.parametrize("named", [{"ef": True}, {"ef": False, "compensation": "ef"}])
def test_checkpoints_that_named_ef_either_way_still_load(tmp_path: Path, named: dict) -> None:
    """EF's checkpoints carried {"ef": true}; one written with an explicit compensation=ef before the switch became
    that method carried {"ef": false, "compensation": "ef"}: both resume an EF run, neither a plain one."""
    from asyncpipe.config import compose
    from asyncpipe.errors import UserError
    from asyncpipe.runtime import checkpoint

    ef = compose(["optimizer=adamw_ef", "delay=1", "run.dir=runs/x"])
    assert compose(["compensation=ef", "delay=1", "run.dir=runs/x"]).compensation.name == "ef"
    ours = checkpoint.fingerprint_of(ef)
    step = _checkpoint_with(tmp_path, {**{k: v for k, v in ours.items() if k != "ef"}, **named})
    assert checkpoint.load(step, ours) == {"x": 1}
    for other in (["optimizer=adamw", "delay=1"], ["compensation=dc", "delay=1"]):
        with pytest.raises(UserError, match="belongs to a different run"):
            checkpoint.load(step, checkpoint.fingerprint_of(compose([*other, "run.dir=runs/x"])))


def test_another_method_is_named_in_the_fingerprint_and_a_damaged_name_is_refused(tmp_path: Path) -> None:
    from asyncpipe.config import compose
    from asyncpipe.errors import UserError
    from asyncpipe.runtime import checkpoint

    ours = checkpoint.fingerprint_of(compose(["compensation=dc", "delay=1", "run.dir=runs/x"]))
    assert ours["ef"] is False and ours["compensation"] == "dc"
    plain = checkpoint.fingerprint_of(compose(["delay=1", "run.dir=runs/x"]))
    assert plain["ef"] is False and "compensation" not in plain  # as checkpoints from before the option
    step = _checkpoint_with(tmp_path, {**ours, "compensation": ["dc"]})
    with pytest.raises(UserError, match="belongs to a different run"):
        checkpoint.load(step, ours)
