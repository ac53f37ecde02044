"""The node's own policy (fedefc_client/policy.py; docs/PRIVACY.md, "The node's own
policy"): a SuperNode's operator names a policy file in the node config, and the
ClientApp refuses every message of a run that breaks it, whatever the run config says;
the server records the refusal with its reason, and the run goes on without the node."""

import json
import stat

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.client import ClientApp, NumPyClient
from flwr.common import (
    FitIns,
    GetPropertiesIns,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.common.constant import ErrorCode
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.compat.common import recorddict_compat as compat
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from common.data_plan import data_plan, secure_weight
from common.dp_accounting import epsilon
from common.methods import load_run_config
from fedefc_client.client_app import app as client_app
from fedefc_client.client_app import NODE_MODS
from fedefc_client.mods import MODS
from fedefc_client.policy import NodePolicy, PolicyError, load_policy
from fedefc_server.dishonest import with_server_faults
from fedefc_server.secure_round import SecureRound
from fedefc_server.strategy import RoundStrategy
from tests.helpers import InProcessGrid, manager
from tests.test_privacy import micro_config, secure_round, server


def write_policy(path, text: str, mode: int = 0o600):
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def run(**keys):
    return load_run_config({"diagnostics": False, **keys})


def policy(**keys) -> NodePolicy:
    return NodePolicy.model_validate(keys)


def test_a_policy_file_is_read_and_validated(tmp_path):
    path = write_policy(tmp_path / "policy.toml", """
        require-secure-aggregation = true
        min-dp-noise-multiplier = 0.8
        max-epsilon = 10.0
        dp-delta = 1e-6
        max-rounds = 200
        methods = ["fedefc", "fedavg"]
        audit-dir = "/var/lib/fedefc/audit"
    """)
    p = load_policy(path)
    assert (p.require_secure_aggregation, p.min_dp_noise_multiplier, p.max_epsilon,
            p.dp_delta, p.max_rounds, p.methods, p.audit_dir) == (
        True, 0.8, 10.0, 1e-6, 200, ("fedefc", "fedavg"), "/var/lib/fedefc/audit")
    assert not p.allow_diagnostics and not p.allow_faults  # refused unless allowed


@pytest.mark.parametrize("text, mode, message", [
    ("require-secure-aggregaton = true", 0o600,
     "unknown key 'require-secure-aggregaton'; the keys are require-secure-aggregation"),
    ("min-dp-noise-multiplier = -1", 0o600,
     "min-dp-noise-multiplier = -1: Input should be greater than or equal to 0"),
    ("max-rounds = \"many\"", 0o600, "max-rounds = 'many': Input should be a valid integer"),
    ("methods = [\"fedsgd\"]", 0o600, "unknown method(s) 'fedsgd'; the methods are fedefc"),
    ("audit-dir = \"audit\"", 0o600, "'audit' is not an absolute path"),
    ("dp-delta = 1.0", 0o600, "dp-delta = 1.0: Input should be less than 1"),
    ("require-secure-aggregation = ", 0o600, "is not valid TOML"),
    ("max-rounds = 5", 0o666, "is writable by others than its owner (mode 0666)"),
    ("max-rounds = 5", 0o620, "chmod go-w"),
    ("max-epsilon = inf", 0o600, "max-epsilon = inf: Input should be a finite number"),
    ("min-dp-noise-multiplier = nan", 0o600, "Input should be a finite number"),
    ("require-secure-aggregation = 'yes'", 0o600,
     "require-secure-aggregation = 'yes': Input should be a valid boolean"),
    ("require-secure-aggregation = 1", 0o600,
     "require-secure-aggregation = 1: Input should be a valid boolean"),
    ("allow-faults = \"false\"", 0o600, "allow-faults = 'false': Input should be a valid "
                                        "boolean"),
    ("max-epsilon = \"10\"", 0o600, "max-epsilon = '10': Input should be a valid number"),
    ("max-rounds = 5.0", 0o600, "max-rounds = 5.0: Input should be a valid integer"),
    ("methods = []", 0o600, "methods = []: an empty list allows no method; "
                            "list the methods this node runs, or leave the key out"),
], ids=["typo", "negative", "type", "method", "relative-dir", "delta", "toml",
        "world-writable", "group-writable", "infinite-epsilon", "nan", "yes", "one",
        "string-bool", "string-number", "float-integer", "no-method"])
def test_a_bad_policy_file_is_refused_naming_the_key_and_the_fix(tmp_path, text, mode,
                                                                 message):
    """Issue 47 (4): at 550afb3 ``max-epsilon = inf`` read as no bound and ``'yes'`` or
    ``1`` as true; issue 58: ``methods = []`` read as every method. Every value is now
    strict and finite, failing closed."""
    path = write_policy(tmp_path / "policy.toml", text, mode)
    with pytest.raises(PolicyError) as err:
        load_policy(path)
    assert message in str(err.value) and path in str(err.value)


def test_a_missing_policy_file_is_refused(tmp_path):
    with pytest.raises(PolicyError, match="cannot be read .* create the file"):
        load_policy(str(tmp_path / "absent.toml"))


def test_a_changed_policy_file_is_read_again(tmp_path):
    path = write_policy(tmp_path / "policy.toml", "max-rounds = 5")
    assert load_policy(path).max_rounds == 5
    write_policy(tmp_path / "policy.toml", "max-rounds = 50")
    assert load_policy(path).max_rounds == 50


@pytest.mark.parametrize("rule, keys, reason", [
    ({"require-secure-aggregation": True}, {},
     "secure-aggregation=false, but this node requires secure aggregation"),
    ({"min-dp-noise-multiplier": 0.5}, {"dp-clip": 1.0, "dp-noise-multiplier": 0.4},
     "dp-noise-multiplier=0.4 is below this node's minimum 0.5"),
    ({"max-rounds": 10}, {"rounds": 11}, "rounds=11 is above this node's max-rounds 10"),
    ({"methods": ["fedavg"]}, {"method": "fedefc"}, "method='fedefc' is not one this node runs"),
    ({}, {"diagnostics": True}, "diagnostics=true, but this node sends no simulation"),
    ({}, {"faults": "raise@0@1"}, "faults='raise@0@1', but this node injects no faults"),
], ids=["secure-aggregation", "noise", "rounds", "method", "diagnostics", "faults"])
def test_each_rule_refuses_the_run_that_breaks_it_and_only_that(rule, keys, reason):
    [got] = policy(**rule).violations(run(**keys))
    assert reason in got
    allowed = {"allow-diagnostics": True, "allow-faults": True}
    compliant = {"secure-aggregation": True, "dp-clip": 1.0, "dp-noise-multiplier": 0.5,
                 "rounds": 10, "method": "fedavg"}
    assert policy(**rule, **allowed).violations(run(**compliant)) == []


def test_max_epsilon_is_the_accountants_over_every_round_at_the_nodes_delta():
    """The node computes epsilon itself (no sampling amplification, its own delta): a
    run just above the bound is refused, just below accepted; without noise, inf."""
    bound = epsilon(1.0, 20, 1e-6)
    strict = policy(**{"max-epsilon": bound * 0.99, "dp-delta": 1e-6})
    loose = policy(**{"max-epsilon": bound * 1.01, "dp-delta": 1e-6})
    noisy = run(**{"dp-clip": 1.0, "dp-noise-multiplier": 1.0, "rounds": 20,
                   "dp-delta": 0.5})  # the run's own delta does not count
    [reason] = strict.violations(noisy)
    assert f"epsilon={bound:.4g} at delta=1e-06, above this node's max-epsilon" in reason
    assert loose.violations(noisy) == []
    assert "epsilon=inf" in loose.violations(run(rounds=20))[0]


def test_a_node_refuses_a_run_against_its_policy_and_the_round_goes_on_without_it(
        micro_mnist_dir, tmp_path):
    """Nodes 0-2 have a strict policy this secure run meets (and keep their own audit
    log); node 3's policy asks for DP noise the run does not add: it answers every message
    with an error naming why, never reads its data nor takes part in SecAgg+, and the
    server records why it is missing."""
    strict = write_policy(tmp_path / "strict.toml", f"""
        require-secure-aggregation = true
        min-dp-noise-multiplier = 0.01
        max-rounds = 3
        methods = ["fedefc"]
        audit-dir = "{tmp_path / 'node-audit'}"
    """)
    noisy = write_policy(tmp_path / "noisy.toml", "min-dp-noise-multiplier = 0.5")
    flat = micro_config(micro_mnist_dir, tmp_path / "out", diagnostics=False,
                        **{"secure-aggregation": True, "dp-clip": 1.0,
                           "dp-noise-multiplier": 0.01})
    configs = {k: {"policy-file": strict} for k in range(3)} | {3: {"policy-file": noisy}}
    grid = InProcessGrid(client_app, flat, 4, configs)
    fields, params = secure_round(flat, grid)
    assert params is not None and fields["partition_ids"] == [0, 1, 2]
    [missing] = fields["unanswered_nodes"]
    assert missing["node"] == "1003"
    assert ("this node's policy refuses the run: dp-noise-multiplier=0.01 is below this "
            "node's minimum 0.5") in missing["reason"]
    refusals = [m for m in grid.received if m.metadata.src_node_id == 1003]
    assert refusals and all(m.has_error() and m.error.code == 6 for m in refusals)
    assert len(grid.contexts[1003].state) == 0  # no SecAgg+ state, nothing of the run
    # the compliant nodes' own audit logs, though the run has audit=false
    assert not load_run_config(flat).audit
    audit = tmp_path / "node-audit"
    assert stat.S_IMODE(audit.stat().st_mode) == 0o700
    for k in range(3):
        log = audit / f"run-1-partition-{k}.jsonl"
        assert stat.S_IMODE(log.stat().st_mode) == 0o600
        stages = [json.loads(x).get("stage") for x in log.read_text().splitlines()]
        assert stages[-4:] == ["setup", "share_keys", "collect_masked_vectors", "unmask"]


def test_an_unusable_policy_file_refuses_every_message_without_naming_its_path(
        micro_mnist_dir, tmp_path):
    (tmp_path / "private-site").mkdir()
    path = write_policy(tmp_path / "private-site" / "policy.toml", "x = 1")
    flat = micro_config(micro_mnist_dir, tmp_path / "out", 2, diagnostics=False)
    grid = InProcessGrid(client_app, flat, 2, {0: {"policy-file": path}})
    proxy = next(p for p in grid.manager().all().values() if p.node_id == 1000)
    with pytest.raises(ValueError, match="unknown key 'x'") as err:
        proxy.get_properties(GetPropertiesIns({}), None, 1)
    assert "private-site" not in str(err.value)
    assert "node policy <node-config:policy-file>" in str(err.value)


# -- a dishonest server: the node trusts only what it signed for ----------------------------
def app_training_to(trained: list[np.ndarray]) -> ClientApp:
    """The project's mods (the node's own, :data:`fedefc_client.client_app.NODE_MODS`, and
    the run's, :data:`fedefc_client.mods.MODS`) around a client whose local
    update returns ``trained`` (5 samples, partition 0): the node's privacy path without
    its data."""
    class Fixed(NumPyClient):
        def fit(self, parameters, config):
            return [a.copy() for a in trained], 5, {"partition-id": 0}

    return ClientApp(client_fn=lambda context: Fixed().to_client(), mods=[*NODE_MODS, *MODS])


def node(run_config: dict, node_config: dict | None = None) -> Context:
    """A node serving partition 0 of the run's clients (the default config's 20)."""
    parts = run_config.get("num-clients", 20)
    return Context(1, 1000, {"partition-id": 0, "num-partitions": parts, **(node_config or {})},
                   RecordDict(), {"diagnostics": False, **run_config})


def train(received: list[np.ndarray], config: dict, server_round: int = 1) -> Message:
    content = compat.fitins_to_recorddict(FitIns(ndarrays_to_parameters(received),
                                                 {"round": server_round, **config}), True)
    return Message(content, 1000, MessageType.TRAIN, group_id=str(server_round))


def arrays_of(reply: Message) -> list[np.ndarray]:
    return parameters_to_ndarrays(compat.recorddict_to_fitres(reply.content, True).parameters)


RECEIVED = [np.zeros(20_000, np.float32)]
TRAINED = [np.full(20_000, 0.1, np.float32)]  # an update of norm sqrt(20000) x 0.1 = 14.1


def test_the_node_clips_with_the_runs_dp_clip_whatever_norm_a_message_carries():
    """Issue 29 (2b): a fit message carrying clipping_norm = 1e9 made the node clip at
    1e9 instead of the run's dp-clip (the update left at norm 14.1; with noise of
    z x dp-clip the effective noise multiplier fell by 1e9 / dp-clip). Now the message is
    refused, naming both values; a message without the key (Flower's DP key is the
    server's to send) is clipped to dp-clip, where the node raised a KeyError before."""
    app, run_config = app_training_to(TRAINED), {"dp-clip": 2.0}
    refused = app(train(RECEIVED, {KEY_CLIPPING_NORM: 1e9}), node(run_config))
    assert refused.has_error() and refused.error.code == ErrorCode.MOD_FAILED_PRECONDITION
    assert ("the server sent clipping_norm=1000000000.0, but the run's signed dp-clip is 2"
            in refused.error.reason)
    for config in ({}, {KEY_CLIPPING_NORM: 2.0}):
        reply = app(train(RECEIVED, config), node(run_config))
        assert not reply.has_error()
        assert np.linalg.norm(arrays_of(reply)[0] - RECEIVED[0]) == pytest.approx(2.0, rel=1e-5)


def setup_message(clients: int, shares: int, threshold: int, clipping_range: float = 8.0,
                  max_weight: float = 100.0, extra: dict | None = None) -> Message:
    return Message(RecordDict({RECORD_KEY_CONFIGS: ConfigRecord({
        Key.STAGE: Stage.SETUP, Key.SAMPLE_NUMBER: clients, Key.SHARE_NUMBER: shares,
        Key.THRESHOLD: threshold, Key.CLIPPING_RANGE: clipping_range,
        Key.TARGET_RANGE: 2**22, Key.MOD_RANGE: 2**32, Key.MAX_WEIGHT: max_weight,
        **(extra or {})})}), 1000, MessageType.TRAIN, group_id="1")


SECURE_RUN = {"secure-aggregation": True, "num-clients": 10, "fraction": 1.0,
              "max-client-samples": 100}  # M = 100: the setup's max_weight


@pytest.mark.parametrize("numbers, node_policy, reason", [
    ((1, 1, 1), {}, "sums 1 client(s), below the run's min-secure-clients=3"),
    ((2, 2, 2), {}, "sums 2 client(s), below the run's min-secure-clients=3"),
    ((4, 4, 2), {}, "has 4 share(s) and a threshold of 2 for 4 clients, but the run's "
                    "num-shares=0 and reconstruction-threshold=0.67 give 4 shares and a "
                    "threshold of 3"),
    ((10, 10, 4), {}, "a threshold of 4 for 10 clients"),
    ((4, 4, 3), {"min-secure-clients": 5},
     "sums 4 client(s), below this node's policy's min-secure-clients=5"),
    ((4, 4, 3, 1e6), {}, "quantizer (clipping range, grid, modulus) is (1000000.0, "),
    ((4, 4, 3, 8.0, 1e12), {}, "the SecAgg+ setup's max_weight is 1000000000000.0, but the "
                               "run's is 100.0 (max-client-samples"),
    ((4, 4, 3, 8.0, 99.0), {}, "max_weight is 99.0, but the run's is 100.0"),
    ((11, 11, 8), {}, "sums 11 clients, above the run's 10 clients per round"),
    ((4, 4, 3, 8.0, 100.0, {"extra": 1}), {},
     "carries field(s) ['extra'] that Flower's setup does not have"),
], ids=["one-client", "two-clients", "half-threshold", "minority-of-10", "policy-minimum",
        "clipping-range", "isolating-max-weight", "other-max-weight", "more-than-the-run",
        "unknown-field"])
def test_a_node_refuses_a_secagg_setup_that_breaks_the_run_or_its_policy(
        tmp_path, numbers, node_policy, reason):
    """Issue 29 (2a): a setup of sample = shares = threshold = 1 was accepted (Flower's
    client checks types only), and the server then unmasked that node's update alone.
    Issue 47 (1): every field is bound to the run config: a max_weight other than the
    run's M (here max-client-samples = 100; at 550afb3 any was accepted), more clients
    than the run's round, a field Flower's setup does not have. The run's own numbers
    for a round the policy allows (secagg_shares: 4 clients, 4 shares, threshold 3; 5, 5
    and 3) are accepted."""
    text = "\n".join(f"{k} = {v}" for k, v in node_policy.items())
    config = {"policy-file": write_policy(tmp_path / "policy.toml", text)} if text else {}
    reply = client_app(setup_message(*numbers), node(SECURE_RUN, config))
    assert reply.has_error() and reply.error.code == ErrorCode.MOD_FAILED_PRECONDITION
    assert reason in reply.error.reason
    allowed = (5, 5, 3) if node_policy else (4, 4, 3)
    honest = client_app(setup_message(*allowed), node(SECURE_RUN, config))
    assert not honest.has_error()
    assert set(honest.content.config_records[RECORD_KEY_CONFIGS]) == {Key.PUBLIC_KEY_1,
                                                                      Key.PUBLIC_KEY_2}


def test_a_policy_minimum_above_the_runs_round_size_refuses_the_run():
    [reason] = policy(**{"min-secure-clients": 11}).violations(run(**SECURE_RUN))
    assert "sums at most 10 clients, below this node's min-secure-clients 11" in reason


def stage_of(msg: Message) -> str | None:
    return msg.content.config_records.get(RECORD_KEY_CONFIGS, {}).get(Key.STAGE)


@pytest.mark.parametrize("server_faults, stage, reason", [
    ("clip=1e9", Stage.COLLECT_MASKED_VECTORS,
     "the server sent clipping_norm=1000000000.0, but the run's signed dp-clip is 0.0001"),
    ("secagg-threshold=1", Stage.SETUP, "has 4 share(s) and a threshold of 1 for 4 clients"),
    ("secagg-sample=1", Stage.SETUP, "the SecAgg+ setup sums 1 client(s), below"),
    ("unmask-both", Stage.UNMASK, "both active and dropped"),
], ids=["clip", "threshold", "sample", "unmask-both"])
def test_a_node_with_a_policy_refuses_what_a_dishonest_server_sends(micro_mnist_dir, tmp_path,
                                                                    server_faults, stage,
                                                                    reason):
    """Issue 29 (2): a node whose policy requires secure aggregation and
    min-dp-noise-multiplier = 1.0, in a run whose config complies (dp-clip 1e-4), below
    a server that deviates from it (replayed by ``server-faults``, through the wrapping
    grid the ServerApp uses: fedefc_server/dishonest.py). At 6a260ce a fit message with
    clipping_norm = 1e9 made the node clip at 1e9, a setup with a threshold or a sample
    of 1 was accepted, and an unmask request naming a node both active and dropped got
    both its secrets' shares. Now every node refuses that stage's message, naming the
    value: no update leaves a node under the forged numbers (no masked vector arrives
    before the unmask stage, no reply holds two shares of one node) and the round is
    left without a sum. The same
    nodes under the honest server complete the round."""
    policy_file = write_policy(tmp_path / "policy.toml", """
        require-secure-aggregation = true
        min-dp-noise-multiplier = 1.0
    """)
    flat = micro_config(micro_mnist_dir, tmp_path / "out", diagnostics=False, **{
        "secure-aggregation": True, "dp-clip": 1e-4, "dp-noise-multiplier": 1.0,
        "server-faults": server_faults})
    nodes = {k: {"policy-file": policy_file} for k in range(4)}
    inner = InProcessGrid(client_app, flat, 4, nodes)
    fields, params = secure_round(flat, with_server_faults(inner, load_run_config(flat)))
    assert params is None and fields["skipped"]
    replies = [(stage_of(q), r) for q, r in zip(inner.sent, inner.received) if stage_of(q)]
    refused = [r for s, r in replies if s == stage]
    assert len(refused) == 4 and all(r.has_error() and reason in r.error.reason
                                     for r in refused)
    for _, reply in replies:
        if not reply.has_error():
            record = reply.content.config_records.get(RECORD_KEY_CONFIGS, {})
            assert stage == Stage.UNMASK or Key.MASKED_PARAMETERS not in record
            ids = record.get(Key.NODE_ID_LIST, [])
            assert len(ids) == len(set(ids))  # never both secrets of one node
    honest = {**flat, "server-faults": ""}
    _, params = secure_round(honest, InProcessGrid(client_app, honest, 4, nodes))
    assert params is not None


def test_a_server_that_weighs_all_but_one_node_by_1e12_is_refused_by_each_of_them(
        micro_mnist_dir, tmp_path):
    """Issue 47 (1), the isolation attack: a dishonest server sends max_weight = 1e12 in
    the SecAgg+ setup to every node but partition 0's, and nothing else changes. At
    550afb3 no node refused (each with a policy requiring secure aggregation and sums of
    at least 5): the four weight factors rounded to 0 and the ordinary unmask stage gave
    the server partition 0's update alone. Now each of the four refuses the setup,
    naming the field, the value sent and the run's M (max-client-samples, else the data
    plan's largest partition); the victim accepts its honest setup, but no masked vector
    leaves any node and no unmask request is sent: nothing is decoded."""
    policy_file = write_policy(tmp_path / "policy.toml", """
        require-secure-aggregation = true
        min-secure-clients = 5
    """)
    flat = micro_config(micro_mnist_dir, tmp_path / "out", 5, diagnostics=False, **{
        "secure-aggregation": True, "server-faults": "secagg-max-weight=1e12@1-4"})
    cfg = load_run_config(flat)
    weight = float(secure_weight(cfg, data_plan(cfg)))
    inner = InProcessGrid(client_app, flat, 5, {k: {"policy-file": policy_file}
                                                 for k in range(5)})
    grid = with_server_faults(inner, cfg)
    _, pipeline, _, init = server(flat, inner)
    mgr = manager([GridClientProxy(nid, grid, 1) for nid in inner.contexts])  # the
    params = ndarrays_to_parameters(init)  # server's proxies send through its grid
    plan = pipeline.plan(1, params, mgr)
    outcome = SecureRound(grid, Context(1, 0, {}, RecordDict(), flat), mgr, cfg)(
        RoundStrategy(pipeline, plan), params)
    assert outcome.parameters is None and outcome.record["skipped"]
    setups = [(q, r) for q, r in zip(inner.sent, inner.received) if stage_of(q) == Stage.SETUP]
    forged = {q.metadata.dst_node_id: r for q, r in setups
              if q.content.config_records[RECORD_KEY_CONFIGS][Key.MAX_WEIGHT] == 1e12}
    assert sorted(forged) == [1001, 1002, 1003, 1004]
    for reply in forged.values():
        assert reply.has_error() and (
            f"the SecAgg+ setup's max_weight is 1000000000000.0, but the run's is {weight!r}"
            in reply.error.reason)
    [(victim, accepted)] = [(q, r) for q, r in setups if q.metadata.dst_node_id == 1000]
    assert victim.content.config_records[RECORD_KEY_CONFIGS][Key.MAX_WEIGHT] == weight
    assert not accepted.has_error()
    assert not any(Key.MASKED_PARAMETERS in r.content.config_records.get(RECORD_KEY_CONFIGS, {})
                   for r in inner.received if not r.has_error())
    assert Stage.UNMASK not in {stage_of(q) for q in inner.sent}


def test_the_epsilon_a_node_enforces_counts_the_releases_it_made_and_is_audited(tmp_path):
    """Issue 29 (2): the node bounded epsilon by the run's rounds, whatever it actually
    released. Now its ledger counts the noised updates that left it, at the noise it
    applied (measured here from the replies), and refuses the release that would take
    epsilon above max-epsilon: a server that sends a third training message in a run of
    two rounds gets a refusal. The node's audit log holds the ledger after each release:
    epsilon from the accountant (common/dp_accounting.py) at that many releases."""
    z, clip, delta = 1.0, 2.0, 1e-6
    bound = epsilon(z, 2, delta) * 1.001  # two releases fit, three do not
    path = write_policy(tmp_path / "policy.toml", f"""
        max-epsilon = {bound}
        dp-delta = {delta}
        audit-dir = "{tmp_path / 'audit'}"
    """)
    ctxt = node({"dp-clip": clip, "dp-noise-multiplier": z, "rounds": 2, "prestopping": False},
                {"policy-file": path})
    assert load_policy(path).violations(load_run_config(ctxt.run_config)) == []
    app = app_training_to(TRAINED)
    replies = [app(train(RECEIVED, {KEY_CLIPPING_NORM: clip}, t), ctxt) for t in (1, 2, 3)]
    assert not replies[0].has_error() and not replies[1].has_error()
    clipped = TRAINED[0] * clip / np.linalg.norm(TRAINED[0])
    noise = arrays_of(replies[0])[0] - clipped
    assert noise.std() == pytest.approx(z * clip, rel=0.03)  # the noise it applied
    assert replies[2].has_error()
    assert (f"one more gives epsilon={epsilon(z, 3, delta):.4g} at delta=1e-06, above this "
            f"node's max-epsilon") in replies[2].error.reason
    entries = [json.loads(x) for x in (tmp_path / "audit" / "run-1-partition-0.jsonl")
               .read_text().splitlines()]
    assert [e.get("dp", {}).get("releases") for e in entries] == [1, 2, None]
    for k, entry in zip((1, 2), entries):
        assert entry["dp"]["epsilon"] == pytest.approx(epsilon(z, k, delta), rel=1e-9)
        assert entry["dp"]["noise-std"] == pytest.approx(z * clip)
        assert entry["dp"]["clip"] == clip and entry["dp"]["delta"] == delta
