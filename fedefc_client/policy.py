"""The node's own policy: what a SuperNode's operator accepts, whatever a run asks
(docs/PRIVACY.md, "The node's own policy").

The run config is the submitter's choice; the node config is the operator's. A node
started with ``--node-config 'policy-file="/etc/fedefc/policy.toml"'`` reads that TOML
file (:class:`NodePolicy`, every key optional) and refuses every message of a run that
breaks it, with the reasons (:func:`.mods.policy_mod`): the server records the node's
error reply as its failure, and the node keeps serving other runs. A policy file that
is missing, malformed, holds an unknown key or is writable by others than its owner
refuses every run too (a node that cannot read its policy does not run without one).

Example::

    require-secure-aggregation = true
    min-dp-noise-multiplier = 0.8      # and so dp-clip > 0 (the noise is z x dp-clip)
    max-epsilon = 10.0                 # at dp-delta, over the run's rounds
    max-rounds = 200
    min-secure-clients = 5             # a SecAgg+ round this node joins sums >= 5 clients
    methods = ["fedefc", "fedavg"]
    audit-dir = "/var/lib/fedefc/audit" # this node's own audit log, always written
    # allow-diagnostics = false, allow-faults = false: the defaults
"""

from __future__ import annotations

import os
import stat
import threading
import tomllib
from logging import WARNING
from pathlib import Path

from flwr.app import Context, Error, Message
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.constant import ErrorCode
from flwr.common.logger import log
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    ValidationError,
    field_validator,
)

from common.config import ConfigError, RunConfig, hyphenate
from common.dp_accounting import epsilon
from common.methods import METHODS, load_run_config

POLICY_KEY = "policy-file"  # node config: the absolute path of the node's policy file


class PolicyError(ConfigError):
    """The node's policy file is unusable; the message names the file, the key and the fix."""


class NodePolicy(BaseModel):
    """The keys of a node's policy file; without a key the node does not restrict it,
    except diagnostics and fault injection, which a node with a policy refuses unless
    it allows them."""

    model_config = ConfigDict(extra="forbid", alias_generator=hyphenate, frozen=True)

    # Strict values only, failing closed: a boolean is true or false (not "yes" or 1),
    # a number is a finite number (not "10"; max-epsilon = inf read as no bound at
    # 550afb3), an integer an integer.
    require_secure_aggregation: StrictBool = False
    min_dp_noise_multiplier: float = Field(0.0, ge=0.0, allow_inf_nan=False, strict=True)
    max_epsilon: float = Field(0.0, ge=0.0, allow_inf_nan=False, strict=True)  # 0: no bound
    dp_delta: float = Field(1e-5, gt=0.0, lt=1.0, strict=True)  # the node's own delta
    max_rounds: int = Field(0, ge=0, strict=True)  # 0: no bound
    min_secure_clients: int = Field(0, ge=0, strict=True)  # 0: the run's; else the
    #                                                        fewest a sum may hold
    methods: tuple[str, ...] | None = None  # None (no key): every method
    allow_diagnostics: StrictBool = False
    allow_faults: StrictBool = False
    audit_dir: StrictStr = ""  # "": the node keeps no audit log of its own

    @field_validator("methods")
    @classmethod
    def _known_methods(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:  # issue 58: an empty list read as every method
            raise ValueError("an empty list allows no method; list the methods this node "
                             "runs, or leave the key out to run every method")
        unknown = [m for m in value if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown method(s) {', '.join(map(repr, unknown))}; the methods "
                             f"are {', '.join(METHODS)}")
        return value

    @field_validator("audit_dir")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if value and not os.path.isabs(value):
            raise ValueError(f"{value!r} is not an absolute path")
        return value

    def violations(self, cfg: RunConfig) -> list[str]:
        """Why the run ``cfg`` breaks this policy, one reason per rule ([] when it
        does not), each naming the run's key and value, the rule and the fix."""
        out = []
        if self.require_secure_aggregation and not cfg.secure_aggregation:
            out.append("secure-aggregation=false, but this node requires secure aggregation "
                       "(require-secure-aggregation): submit with secure-aggregation=true")
        z = cfg.dp_noise_multiplier
        if z < self.min_dp_noise_multiplier:
            out.append(f"dp-noise-multiplier={z:g} is below this node's minimum "
                       f"{self.min_dp_noise_multiplier:g} (min-dp-noise-multiplier): submit "
                       f"with dp-noise-multiplier >= {self.min_dp_noise_multiplier:g} and "
                       "dp-clip > 0")
        if self.max_epsilon > 0:
            eps = epsilon(z, cfg.rounds, self.dp_delta)
            if eps > self.max_epsilon:
                out.append(f"dp-noise-multiplier={z:g} over rounds={cfg.rounds} gives epsilon="
                           f"{eps:.4g} at delta={self.dp_delta:g}, above this node's "
                           f"max-epsilon {self.max_epsilon:g}: raise dp-noise-multiplier or "
                           "lower rounds")
        if self.min_secure_clients > cfg.clients_per_round and cfg.secure_aggregation:
            out.append(f"a secure round of this run sums at most {cfg.clients_per_round} "
                       f"clients, below this node's min-secure-clients "
                       f"{self.min_secure_clients}: raise fraction or num-clients")
        if self.max_rounds and cfg.rounds > self.max_rounds:
            out.append(f"rounds={cfg.rounds} is above this node's max-rounds "
                       f"{self.max_rounds}")
        if self.methods is not None and cfg.method not in self.methods:
            out.append(f"method={cfg.method!r} is not one this node runs "
                       f"({', '.join(self.methods)})")
        if cfg.diagnostics and not self.allow_diagnostics:
            out.append("diagnostics=true, but this node sends no simulation diagnostics "
                       "(allow-diagnostics): submit with diagnostics=false")
        if cfg.faults and not self.allow_faults:
            out.append(f"faults={cfg.faults!r}, but this node injects no faults "
                       "(allow-faults): submit with faults=\"\"")
        return out


_CACHE: dict[tuple, NodePolicy] = {}
_LOCK = threading.Lock()


def policy_path(node_config: dict) -> str | None:
    """The node config's ``policy-file`` (None without one); a value that is not an
    absolute path is refused."""
    value = node_config.get(POLICY_KEY)
    if value is None:
        return None
    if not (isinstance(value, str) and os.path.isabs(value)):
        raise PolicyError(f"node config {POLICY_KEY}={value!r} is not an absolute path; "
                          f"write it quoted, e.g. --node-config "
                          f"'{POLICY_KEY}=\"/etc/fedefc/policy.toml\"'")
    return value


def load_policy(path: str) -> NodePolicy:
    """The policy in the TOML file ``path``, validated (cached per process while the file
    is unchanged); :class:`PolicyError` names what is wrong and the fix."""
    where = f"node policy {path}"
    try:
        st = os.stat(path)
    except OSError as err:
        raise PolicyError(f"{where} cannot be read ({err.strerror}); fix the node config's "
                          f"{POLICY_KEY} or create the file") from None
    if not stat.S_ISREG(st.st_mode):
        raise PolicyError(f"{where} is not a file")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PolicyError(f"{where} is writable by others than its owner (mode "
                          f"{stat.S_IMODE(st.st_mode):04o}); anyone who can edit it can relax "
                          f"it: chmod go-w {path}")
    key = (path, st.st_mtime_ns, st.st_size, st.st_ino)
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise PolicyError(f"{where} is not valid TOML ({err}); fix the file") from None
    try:
        policy = NodePolicy.model_validate(data)
    except ValidationError as err:
        raise PolicyError(f"{where}: " + "; ".join(_describe(e) for e in err.errors())
                          ) from None
    with _LOCK:
        _CACHE[key] = policy
    return policy


def _describe(error: dict) -> str:
    key = ".".join(str(x) for x in error["loc"])
    if error["type"] == "extra_forbidden":
        return (f"unknown key {key!r}; the keys are "
                f"{', '.join(f.alias for f in NodePolicy.model_fields.values())}")
    return f"{key} = {error.get('input')!r:.60}: {error['msg'].removeprefix('Value error, ')}"


def describe_refusal(problems: list[str]) -> str:
    """The error reply's text for a run this node's policy refuses."""
    return "this node's policy refuses the run: " + "; ".join(problems)


# -- the node's policy as the ClientApp's mod (docs/PRIVACY.md §5) --
def node_policy(ctxt: Context) -> NodePolicy | None:
    """The node's policy (its node config's ``policy-file``; None: none)."""
    path = policy_path(ctxt.node_config)
    return None if path is None else load_policy(path)


def policy_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """With a ``policy-file`` in the node config, answer every message of a run that
    breaks the node's policy with an error reply giving the reasons
    (:meth:`NodePolicy.violations`), Flower's code for a mod's failed precondition; the
    node serves other runs as before. An unusable policy file raises (every message is
    refused, naming the problem)."""
    policy = node_policy(ctxt)
    if policy is None:
        return call_next(msg, ctxt)
    problems = policy.violations(load_run_config(ctxt.run_config))
    if not problems:
        return call_next(msg, ctxt)
    return refuse(msg, ctxt, describe_refusal(problems))


def refuse(msg: Message, ctxt: Context, reason: str) -> Message:
    """An error reply with ``reason`` (Flower's code for a mod's failed precondition)."""
    log(WARNING, "run %s: %s", ctxt.run_id, reason)
    return Message(Error(ErrorCode.MOD_FAILED_PRECONDITION, reason), reply_to=msg)
