"""grep-level: EF's rule has one home (asyncpipe/optim/compensation/ef.py; its torch-free declaration:
asyncpipe/compensation/ef.py), and the *_ef presets' switch
`optimizer.ef.*` is read only where it is resolved (config/alias.py) or where old records are read (report/load,
report/groups, report/claims, describe's key list, the bench's refused keys)."""

from __future__ import annotations

import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "asyncpipe"
EF_HOME = "optim/compensation/ef.py"
EF_DECLARATION = "compensation/ef.py"  # its settings and their check
# Where the switch may still be named in code (not comments/docstrings): its resolution, its key list for `config
# show`, reading records written before it became an alias, and the bench's list of keys its variants set.
SWITCH_READERS = {"config/alias.py", "config/describe.py", "report/load.py", "report/groups.py",
                  "bench/simulator.py",
                  "config/validate.py", EF_DECLARATION}  # these two only name it in a message (an unresolved switch; lam's check)


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
    assert "config/alias.py" in readers


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
