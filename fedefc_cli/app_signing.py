"""Only the coordinator's app runs: signed apps, checked where they would run.

Why not Flower's own ``flower-supernode --trusted-entities``: in Flower 1.42 a SuperNode
started with it refuses every app whose FAB carries no ``valid_license`` verification
(``flwr/supernode/start_client_internal.py``: ``_pull_and_store_message``), and the
SuperLink attaches verifications only to apps fetched from Flower Hub
(``flwr/superlink/servicer/control/control_handlers.py``: ``start_run`` stores
``verification_dict = {}`` for a FAB sent by ``flwr run`` of a local folder;
``_format_verification`` is called for Hub apps only). A signature made with ``flwr app
review`` is submitted to the Hub, never to a SuperLink. So with ``flwr run .`` every run,
the coordinator's included, fails on such a node (docs/DEPLOYMENT.md, "Outsiders on the
network").

The equivalent here, in Flower's key format (an Ed25519 OpenSSH key; the trusted keys
file is ``--trusted-entities``' YAML, ``key-id: "ssh-ed25519 AAAA..."``):

- :func:`stage_signed_app` (``fedefc deploy submit --sign-key``) copies the FAB that
  ``flwr run`` would build, adds :data:`SIGNATURE_FILE`: the SHA-256 of every file of the
  app and the whole run config the run will see (the app's defaults fused with the
  submission's overrides, as Flower fuses them), signed with the coordinator's key;
- :func:`check_signed_fab` runs on the node (and on the SuperLink machine) in the process
  that would run the app, BEFORE the app is installed or imported
  (:mod:`.trusted_apps`): a FAB without a signature, one signed by a key that is not
  trusted, a changed or added file, or a run config other than the signed one is refused.

A valid signature can be replayed only as it is: the same code with the same run config.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import time
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import tomli_w
import yaml
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from .app_files import MANIFEST, app_files, write_app

SIGNATURE_FILE = "fedefc-signature.json"
FORMAT = 1


class UntrustedAppError(RuntimeError):
    """An app that this machine must not run; the message says why and what fixes it."""


class SigningKeyError(ValueError):
    """A signing key or trusted-keys file is unusable; the message names it and the fix."""


# -- keys ----------------------------------------------------------------------------------
def load_trusted_keys(path: str | Path) -> dict[str, ed25519.Ed25519PublicKey]:
    """The trusted keys file: Flower's ``--trusted-entities`` YAML (key id -> OpenSSH
    Ed25519 public key), as written by deploy/gen-signing-key.sh."""
    file = Path(path).expanduser()
    try:
        raw = yaml.safe_load(file.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise SigningKeyError(f"trusted keys file {file} is unreadable ({err}); write it with "
                              "deploy/gen-signing-key.sh") from None
    if not isinstance(raw, dict) or not raw:
        raise SigningKeyError(f"trusted keys file {file} holds no 'key-id: \"ssh-ed25519 "
                              "...\"' line; write it with deploy/gen-signing-key.sh")
    keys = {}
    for key_id, text in raw.items():
        try:
            key = serialization.load_ssh_public_key(str(text).encode())
        except (ValueError, TypeError) as err:
            raise SigningKeyError(f"trusted keys file {file}: key {key_id!r} is not an OpenSSH "
                                  f"public key ({err})") from None
        if not isinstance(key, ed25519.Ed25519PublicKey):
            raise SigningKeyError(f"trusted keys file {file}: key {key_id!r} is not Ed25519 "
                                  "(deploy/gen-signing-key.sh writes one)")
        keys[str(key_id)] = key
    return keys


def load_signing_key(path: str | Path) -> ed25519.Ed25519PrivateKey:
    """The coordinator's private Ed25519 key (OpenSSH format, deploy/gen-signing-key.sh)."""
    file = Path(path).expanduser()
    try:
        key = serialization.load_ssh_private_key(file.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as err:
        raise SigningKeyError(f"signing key {file} is unreadable ({err}); write one with "
                              "deploy/gen-signing-key.sh") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise SigningKeyError(f"signing key {file} is not Ed25519 (deploy/gen-signing-key.sh "
                              "writes one)")
    return key


# -- what is signed --------------------------------------------------------------------------
def _canonical(document: dict[str, Any]) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def _signed_part(signature: dict[str, Any]) -> bytes:
    return _canonical({k: v for k, v in signature.items() if k != "signature"})


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def file_hashes(files: dict[str, bytes]) -> dict[str, str]:
    """SHA-256 of every app file, except Flower's manifest and the signature itself."""
    return {name: hashlib.sha256(data).hexdigest() for name, data in sorted(files.items())
            if name not in (MANIFEST, SIGNATURE_FILE)}


def fused_run_config(fab_files: dict[str, bytes], overrides: dict[str, Any]) -> dict[str, Any]:
    """The run config a run of this app sees: its pyproject's defaults with the overrides,
    fused by Flower's own functions (what the SuperNode and the ServerApp process do)."""
    config = tomllib.loads(fab_files["pyproject.toml"].decode())
    from flwr.common.config import flatten_dict, fuse_dicts  # lazy: flwr, 0.5 s of CPU
    defaults = flatten_dict(config["tool"]["flwr"]["app"].get("config", {}))
    return dict(fuse_dicts(defaults, dict(overrides)))


def _as_transmitted(overrides: dict[str, Any]) -> dict[str, Any]:
    """The overrides as a SuperLink hands them on (through Flower's protobuf form)."""
    from flwr.common.serde import (  # lazy: flwr, 0.4 s of CPU
        user_config_from_proto,
        user_config_to_proto,
    )
    return dict(user_config_from_proto(user_config_to_proto(overrides)))


# -- the coordinator's side ------------------------------------------------------------------
def stage_signed_app(app_dir: Path, overrides: dict[str, Any], key_path: str | Path,
                     key_id: str, dest: Path) -> Path:
    """Write into ``dest`` the app ``flwr run app_dir`` would ship, plus its signature for
    a run with ``overrides`` (as parsed from the ``--run-config`` file); ``flwr run dest``
    then submits exactly what was signed. Returns ``dest``."""
    key = load_signing_key(key_path)
    files = app_files(app_dir)
    pyproject = tomllib.loads(files["pyproject.toml"].decode())
    include = pyproject["tool"]["flwr"]["app"].get("fab-include")
    if include is not None and SIGNATURE_FILE not in include:  # ship the signature too
        include.append(SIGNATURE_FILE)
        files["pyproject.toml"] = tomli_w.dumps(pyproject).encode()
    signature = {"format": FORMAT, "key-id": key_id, "signed-at": int(time.time()),
                 "files": file_hashes(files),
                 "run-config": fused_run_config(files, _as_transmitted(overrides))}
    signature["signature"] = _b64(key.sign(_signed_part(signature)))
    return write_app({**files, SIGNATURE_FILE: _canonical(signature)}, dest)


# -- the node's side ------------------------------------------------------------------------
def check_signed_fab(fab_content: bytes, run_config: dict[str, Any],
                     trusted: dict[str, ed25519.Ed25519PublicKey]) -> str:
    """Return the key id that signed this FAB for this run config; UntrustedAppError
    (saying what is wrong) unless a trusted key signed exactly these files and config."""
    fix = ("the coordinator submits with `fedefc deploy submit --sign-key KEY` using a key "
           "this machine trusts (docs/DEPLOYMENT.md, \"Outsiders on the network\")")
    try:
        with zipfile.ZipFile(io.BytesIO(fab_content)) as fab:
            files = {n: fab.read(n) for n in fab.namelist()}
    except zipfile.BadZipFile:
        raise UntrustedAppError("refused: the app is not a readable FAB") from None
    if SIGNATURE_FILE not in files:
        raise UntrustedAppError(f"refused: the app is not signed (no {SIGNATURE_FILE}); {fix}")
    try:
        signature = json.loads(files[SIGNATURE_FILE])
        key_id, sig = str(signature["key-id"]), _unb64(str(signature["signature"]))
    except (ValueError, KeyError, TypeError):
        raise UntrustedAppError(f"refused: {SIGNATURE_FILE} is malformed; {fix}") from None
    if key_id not in trusted:
        raise UntrustedAppError(f"refused: the app is signed by key {key_id!r}, which this "
                                f"machine does not trust (trusted: {sorted(trusted)}); {fix}")
    try:
        trusted[key_id].verify(sig, _signed_part(signature))
    except InvalidSignature:
        raise UntrustedAppError(f"refused: the signature of key {key_id!r} does not verify "
                                f"(the signature file was altered); {fix}") from None
    if signature.get("format") != FORMAT:
        raise UntrustedAppError(f"refused: signature format {signature.get('format')!r} "
                                f"is not {FORMAT}")
    actual, signed = file_hashes(files), signature.get("files", {})
    changed = sorted(n for n in actual.keys() | signed.keys() if actual.get(n) != signed.get(n))
    if changed:
        raise UntrustedAppError(f"refused: files differ from what key {key_id!r} signed: "
                                f"{', '.join(changed)}")
    if _canonical(dict(run_config)) != _canonical(signature.get("run-config", {})):
        diff = sorted(k for k in set(run_config) | set(signature.get("run-config", {}))
                      if run_config.get(k) != signature["run-config"].get(k))
        raise UntrustedAppError(f"refused: the run config differs from the one key {key_id!r} "
                                f"signed, in {', '.join(diff) or 'its value types'}")
    return key_id
