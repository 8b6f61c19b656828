"""What `rljob run` (no cluster) does with spec.env, spec.envFrom and spec.volumes.

spec.env's literal values are set for the ranks, over the shell's, as a container's env is set
over its image's; valueFrom and envFrom read Secrets and ConfigMaps, which only a cluster has,
so locally the shell's environment stands in for them. Volumes are not mounted: the paths in
the spec are read on this machine (docs/volumes-and-env.md).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from rljob.api import RLJobSpec

# Kubernetes' dependent variables: $(NAME) is the value of an earlier variable (left as it is
# when there is none), and $$ is a literal $.
_REFERENCE = re.compile(r"\$\$|\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")


def expand(value: str, env: Mapping[str, str]) -> str:
    """`value` with $(NAME) references expanded from `env`, as the kubelet expands them."""

    def one(match: re.Match[str]) -> str:
        if match.group() == "$$":
            return "$"
        return env.get(match.group(1), match.group())

    return _REFERENCE.sub(one, value)


def unresolved(value: str, env: Mapping[str, str]) -> list[str]:
    """The names `value` references ($(NAME), not $$-escaped) that `env` does not have."""
    return [m.group(1) for m in _REFERENCE.finditer(value) if m.group(1) and m.group(1) not in env]


@dataclass
class LocalEnv:
    """The variables to set for the ranks, and what only a cluster would have supplied."""

    values: dict[str, str] = field(default_factory=dict)
    cluster_only: list[str] = field(default_factory=list)
    # "HF_HOME: $(SCRATCH)": references left as written (no earlier variable of that name),
    # as the pod leaves them; usually a mistake worth a line.
    unexpanded: list[str] = field(default_factory=list)


def local_env(spec: RLJobSpec, environ: Mapping[str, str]) -> LocalEnv:
    """spec.env's literal values, expanded as the kubelet would, and a line for every valueFrom
    and envFrom entry saying where it would have come from.

    The kubelet expands $(NAME) against envFrom's variables and the entries before, never the
    image's environment: so here against the entries before (a valueFrom one by the shell's
    value, which stands in for the Secret's), and against the whole shell only where envFrom
    is given (its keys are not known here; the shell stands in for them). $(HOME) without
    envFrom stays $(HOME), as in the pod."""
    out = LocalEnv()
    seen = dict(environ) if spec.env_from else {}
    earlier: set[str] = set()  # every entry before, also a valueFrom one the shell lacks
    for source in spec.env_from:
        ref = source.secret_ref or source.config_map_ref
        kind = "Secret" if source.secret_ref else "ConfigMap"
        out.cluster_only.append(f"envFrom {kind} {ref.name if ref else '?'}")
    for var in spec.env:
        if var.value is not None:
            out.unexpanded += [
                f"{var.name}: $({name})"
                for name in unresolved(var.value, seen)
                if name not in earlier
            ]
            seen[var.name] = out.values[var.name] = expand(var.value, seen)
            earlier.add(var.name)
            continue
        earlier.add(var.name)
        if var.name in environ:
            seen[var.name] = environ[var.name]
        value_from = var.value_from
        key = value_from.secret_key_ref or value_from.config_map_key_ref if value_from else None
        kind = "Secret" if value_from and value_from.secret_key_ref else "ConfigMap"
        here = "taken from your shell" if var.name in environ else "not set here"
        where = f"{kind} {key.name} key {key.key}" if key else "?"
        out.cluster_only.append(f"{var.name} ({where}; {here})")
    return out
