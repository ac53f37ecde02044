"""The operator's allowlist: which authenticated node may serve which partition, with
which data and how many samples (docs/THREAT-MODEL.md, "Identity and partitions").

A node's declaration (:mod:`.declarations`) is what the node says about itself; the
allowlist is what the federation's operator says about it, keyed by the public key the
node authenticates with (``flower-supernode --auth-supernode-private-key``; the key
``flwr supernode register`` registers). Flower 1.42's SuperLink verifies every request
of a node against its key and hands the ServerApp each node's key with its id
(``Grid.get_nodes()``: ``NodeInfo.public_key``), so the registry binds a node id to
its key, and the key to its one entry. The run-config key ``allowlist`` names the file,
an absolute path on the machine that runs the ServerApp; it is read once per run
(to hand a partition to another key, the operator edits the file and resumes the run).

The file (TOML), one ``[[node]]`` table per node::

    [[node]]
    public-key = "ecdsa-sha2-nistp384 AAAAE2Vj... site-a"  # its key.pub, or "SHA256:..."
    partition-id = 0
    data = "private"            # "partition" (of the run's dataset) | "private"
    max-samples = 12000         # the most training samples it may declare
    held-out-samples = 3000     # the most held-out samples (federated evaluation); 0
    name = "site-a"             # optional: the site's name in curves.png's rows

A key is compared by its fingerprint, the SHA-256 that ``ssh-keygen -l -f key.pub``
prints, so an entry may give either the ``key.pub`` line or that fingerprint. Every key
and every partition appears at most once.
"""

from __future__ import annotations

import base64
import hashlib
import tomllib
from pathlib import Path
from typing import Literal

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from common.config import FLAT_KEYS, ConfigError


class AllowlistError(ConfigError):
    """The allowlist file is missing or invalid; the message names the file, the entry,
    the key and the fix."""


def key_fingerprint(key: bytes | str) -> str | None:
    """The SHA-256 fingerprint of a public key as ``ssh-keygen -l`` prints it, from its
    PEM form (what Flower stores) or its OpenSSH line (``key.pub``); None for anything
    that does not parse as a key (a simulated node's random bytes, or text that merely
    looks like a fingerprint)."""
    raw = key if isinstance(key, bytes) else key.encode()
    try:
        public = (serialization.load_pem_public_key(raw) if b"-----BEGIN" in raw
                  else serialization.load_ssh_public_key(raw.strip()))
        blob = base64.b64decode(public.public_bytes(serialization.Encoding.OpenSSH,
                                                    serialization.PublicFormat.OpenSSH).split()[1])
    except (ValueError, TypeError, IndexError, UnsupportedAlgorithm):
        return None
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def fingerprint(key: bytes | str) -> str:
    """An allowlist entry's key as a fingerprint: :func:`key_fingerprint` of its
    ``key.pub`` line or PEM, or the ``SHA256:`` fingerprint the operator wrote. Bytes
    that are no key get the digest of the bytes, which matches no key's fingerprint.
    Only entries are read this way: a node's key is matched by :func:`key_fingerprint`
    alone (:meth:`Allowlist.entry`)."""
    text = key.decode("ascii", "replace") if isinstance(key, bytes) else key
    if text.startswith("SHA256:"):
        return text.strip()
    raw = key if isinstance(key, bytes) else key.encode()
    found = key_fingerprint(raw)
    if found is not None:
        return found
    blob = b"not a public key:" + raw
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


class AllowedNode(BaseModel):
    """One node the operator admits: its key, its partition, its data kind and sizes."""

    model_config = FLAT_KEYS

    public_key: str = Field(min_length=1)
    partition_id: int = Field(ge=0)
    data: Literal["partition", "private"]  # common/messages.py: Declaration.KINDS
    max_samples: int = Field(ge=1)
    held_out_samples: int = Field(0, ge=0)
    name: str | None = Field(None, min_length=1, max_length=40)

    @field_validator("public_key")
    @classmethod
    def _a_key(cls, value: str) -> str:
        if value.startswith("SHA256:"):
            return value
        try:
            serialization.load_ssh_public_key(value.strip().encode())
        except (ValueError, UnsupportedAlgorithm) as err:
            raise ValueError(f"{value[:30]!r}... is neither an OpenSSH public key line (the "
                             f"node's key.pub) nor a SHA256: fingerprint ({err})") from None
        return value

    @property
    def key_id(self) -> str:
        return fingerprint(self.public_key)

    def vet(self, partition: int, data: str, num_examples: int, held_out: int) -> str | None:
        """Why a declaration breaks this entry, or None."""
        if partition != self.partition_id:
            return (f"declares partition {partition}, but the allowlist gives its key "
                    f"partition {self.partition_id}")
        if data != self.data:
            return f"declares {data} data, but the allowlist says {self.data}"
        if num_examples > self.max_samples:
            return (f"declares {num_examples} samples, above its allowlist entry's "
                    f"max-samples {self.max_samples}")
        if held_out > self.held_out_samples:
            return (f"declares {held_out} held-out samples, above its allowlist entry's "
                    f"held-out-samples {self.held_out_samples}")
        return None


class Allowlist(BaseModel):
    """Every node the operator admits (module docstring)."""

    model_config = FLAT_KEYS

    node: list[AllowedNode] = Field(min_length=1)

    @model_validator(mode="after")
    def _one_entry_each(self) -> Allowlist:
        for what, ids in (("public key", [n.key_id for n in self.node]),
                          ("partition-id", [n.partition_id for n in self.node])):
            twice = sorted({str(i) for i in ids if ids.count(i) > 1})
            if twice:
                raise ValueError(f"{what} {', '.join(twice)} appears in more than one entry; "
                                 "each node and each partition has exactly one")
        return self

    @classmethod
    def load(cls, path: str, num_clients: int) -> Allowlist:
        """Read and validate the operator's file for a run of ``num_clients``
        partitions; :class:`AllowlistError` names what is wrong and the fix."""
        where = f"allowlist={path!r}"
        try:
            raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as err:
            raise AllowlistError(f"{where}: cannot read it ({err.strerror}); write the file "
                                 "as docs/THREAT-MODEL.md shows, on the machine that runs "
                                 "the ServerApp") from None
        except tomllib.TOMLDecodeError as err:
            raise AllowlistError(f"{where}: not valid TOML ({err})") from None
        try:
            allowlist = cls.model_validate(raw)
        except ValidationError as err:
            lines = []
            for item in err.errors():
                loc = ".".join(str(x) for x in item["loc"])
                lines.append(f"{loc or 'file'}: {item['msg'].removeprefix('Value error, ')}")
            raise AllowlistError(f"{where}: {'; '.join(lines)} (docs/THREAT-MODEL.md shows "
                                 "the format)") from None
        outside = [n.partition_id for n in allowlist.node if n.partition_id >= num_clients]
        if outside:
            raise AllowlistError(f"{where}: partition-id {outside[0]} is outside "
                                 f"0..{num_clients - 1} (num-clients={num_clients})")
        return allowlist

    def site_names(self) -> dict[str, str]:
        """{partition id (text, as JSON keys are): the site's name} for the entries
        that name one (the summary's ``site_names``, curves.png's rows)."""
        return {str(n.partition_id): n.name for n in self.node if n.name is not None}

    def entry(self, public_key: bytes | None) -> AllowedNode | None:
        """The entry of the node with ``public_key`` (as Flower stores it), or None: a key
        that does not parse as one matches no entry, whatever its bytes say (a node's key
        whose bytes are the text ``SHA256:<an entry's fingerprint>`` is no key)."""
        key_id = None if public_key is None else key_fingerprint(public_key)
        if key_id is None:
            return None
        return next((n for n in self.node if n.key_id == key_id), None)

