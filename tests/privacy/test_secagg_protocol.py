"""SecAgg+ protocol state machines: exact sums under dropouts at every stage, and bad input rejected."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from privacy import PrivacyError
from privacy.secagg import check_threshold
from privacy.secagg.protocol import (
    CIPHERTEXT_BYTES,
    PublicKeys,
    SecAggAborted,
    SecAggClient,
    SecAggParams,
    SecAggRejected,
    SecAggServer,
    ring_dtype,
)
from privacy.secagg import protocol, shamir

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_params(n: int, k: int, t: int, bits: int = 32, dim: int = 50, clip: float = 1.0) -> SecAggParams:
    return SecAggParams.create(1, range(101, 101 + n), degree=k, threshold=t, bits=bits, clip=clip, dim=dim)


def run(params: SecAggParams, drop: dict[str, set[int]] | None = None, seed: int = 0):
    """All four stages in memory; nodes in ``drop[stage]`` vanish before answering that stage.

    Returns the server's result and the plain ring sum of the survivors' inputs.
    """
    drop = drop or {}
    gone: set[int] = set()
    gen = torch.Generator().manual_seed(seed)
    server = SecAggServer(params)
    clients: dict[int, SecAggClient] = {}
    gone |= drop.get("setup", set())
    for v in params.nodes:
        if v in gone:
            continue
        clients[v], keys = SecAggClient.setup(v, params)
        server.on_keys(v, keys)
    reqs = server.share_keys_requests()
    gone |= drop.get("share-keys", set())
    for v, keys in reqs.items():
        if v not in gone:
            server.on_shares(v, clients[v].share_keys(keys))
    reqs = server.masked_input_requests()
    gone |= drop.get("masked-input", set())
    inputs = {}
    for v, cts in reqs.items():
        if v in gone:
            continue
        clients[v].receive_shares(cts)
        inputs[v] = torch.randint(0, params.levels + 1, (params.dim,), generator=gen)
        masked = clients[v].mask(inputs[v])
        server.add_masked(v, masked)
    reqs = server.unmask_requests()
    gone |= drop.get("unmask", set())
    for v, (surv, dropped) in reqs.items():
        if v not in gone:
            try:
                server.on_unmask(v, clients[v].unmask(surv, dropped))
            except SecAggRejected as exc:  # too few of its neighbours survived: it refuses, as it must
                assert exc.rule == "too-few-neighbours"
    result = server.finish()
    plain = sum(inputs[v] for v in result.survivors) & ((1 << params.bits) - 1)
    return result, plain, inputs


@pytest.mark.parametrize("n,k,t", [(3, 2, 2), (5, 4, 3), (10, 4, 3), (12, 11, 7)])
def test_sum_is_exact_without_dropouts(n, k, t):
    result, plain, inputs = run(make_params(n, k, t))
    assert result.survivors == tuple(sorted(inputs)) and not result.dropped
    assert torch.equal(result.total, plain)


@FAST
@given(n=st.integers(5, 14), bits=st.sampled_from([8, 16, 32]), data=st.data())
def test_sum_is_exact_under_dropouts_at_every_stage(n, bits, data):
    k = data.draw(st.sampled_from([k for k in range(2, n - 1, 2)] + [n - 1]))
    kk = min(k, n - 1)
    t = data.draw(st.integers(kk // 2 + 1, kk))
    params = make_params(n, k, t, bits=bits, dim=data.draw(st.integers(1, 40)))
    nodes = list(params.nodes)
    drop = {s: set(data.draw(st.lists(st.sampled_from(nodes), max_size=2))) for s in
            ("setup", "share-keys", "masked-input", "unmask")}
    try:
        result, plain, _ = run(params, drop, seed=n)
    except SecAggAborted:
        return  # too many dropouts for this graph: a clear failure, never a wrong sum
    assert torch.equal(result.total, plain)
    assert set(result.survivors).isdisjoint(drop["setup"] | drop["share-keys"] | drop["masked-input"])


def test_drop_after_share_keys_is_recovered_and_masks_cancel():
    params = make_params(8, 4, 3)
    victim = params.nodes[3]
    result, plain, _ = run(params, {"masked-input": {victim}})
    assert victim in result.dropped and victim not in result.survivors
    assert torch.equal(result.total, plain)


def test_too_many_dropouts_abort_with_a_reason():
    params = make_params(6, 5, 4)
    with pytest.raises(SecAggAborted, match="masked inputs arrived|live"):
        run(params, {"masked-input": set(params.nodes[:4])})
    with pytest.raises(SecAggAborted, match="needs t=4 shares"):
        run(params, {"unmask": set(params.nodes[:3])})


def test_dequantized_sum_matches_float_sum():
    params = make_params(5, 4, 3, dim=1000, clip=2.0)
    xs = {v: torch.rand(1000, dtype=torch.float64) * 4 - 2 for v in params.nodes}
    q = {v: torch.round((x + 2.0) / params.step).to(torch.int64) for v, x in xs.items()}
    total = sum(q.values()) & 0xFFFFFFFF
    from privacy.secagg.protocol import SecAggResult
    out = SecAggResult(total=total, survivors=params.nodes, dropped=(), params=params).dequantized()
    assert torch.allclose(out, sum(xs.values()), atol=5 * params.step)


def test_masked_input_looks_uniform():
    """One client's masked input is indistinguishable from uniform (chi-square on the top byte)."""
    params = make_params(4, 3, 2, dim=1 << 16)
    me, _ = SecAggClient.setup(params.nodes[0], params)
    others = {v: SecAggClient.setup(v, params) for v in params.nodes[1:]}
    keys = {params.nodes[0]: PublicKeys(me.c.public_bytes, me.s.public_bytes, b"\0" * 32),
            **{v: k for v, (_, k) in others.items()}}
    me.share_keys(keys)
    cts = {v: c.share_keys(keys)[params.nodes[0]] for v, (c, _) in others.items()}
    me.receive_shares(cts)
    masked = me.mask(torch.zeros(params.dim, dtype=torch.int64))  # an all-zero input: only masks remain
    counts = np.bincount(masked >> 24, minlength=256)
    expected = params.dim / 256
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 330.52  # df = 255, p = 0.999


# -- bad input: each rejected with a reason, the honest round unaffected --------------------------
def started(n=6, k=5, t=4, bits=32):
    params = make_params(n, k, t, bits=bits)
    server = SecAggServer(params)
    clients, keys = {}, {}
    for v in params.nodes:
        clients[v], keys[v] = SecAggClient.setup(v, params)
        server.on_keys(v, keys[v])
    return params, server, clients, keys


def shared(n=6, k=5, t=4, bits=32):
    """A round past share-keys: (params, server, clients, the masked-input requests)."""
    params, server, clients, _ = started(n, k, t, bits)
    reqs = server.share_keys_requests()
    for v in params.nodes:
        server.on_shares(v, clients[v].share_keys(reqs[v]))
    return params, server, clients, server.masked_input_requests()


def masked(n=6, k=5, t=4):
    """A round where every client has received its shares and masked a zero vector: (params, server, clients)."""
    params, server, clients, reqs = shared(n, k, t)
    for v in params.nodes:
        clients[v].receive_shares(reqs[v])
        clients[v].mask(torch.zeros(params.dim, dtype=torch.int64))
    return params, server, clients


def test_server_rejects_bad_stage_one_messages():
    params, server, clients, keys = started()
    with pytest.raises(SecAggRejected, match="duplicate"):
        server.on_keys(params.nodes[0], keys[params.nodes[0]])
    with pytest.raises(SecAggRejected, match="unknown-sender"):
        server.on_keys(999, keys[params.nodes[0]])
    with pytest.raises(SecAggRejected, match="bad-keys"):
        PublicKeys.from_bytes(7, b"short")
    fresh = SecAggServer(params)
    fresh.on_keys(params.nodes[0], keys[params.nodes[0]])
    with pytest.raises(SecAggRejected, match="bad-keys"):  # a node replaying another's keys
        fresh.on_keys(params.nodes[1], keys[params.nodes[0]])


def test_client_rejects_substituted_or_replayed_messages():
    params, server, clients, keys = started()
    reqs = server.share_keys_requests()
    a, b = params.nodes[0], params.nodes[1]
    forged = dict(reqs[a])
    forged[a] = keys[b]  # the server swaps this node's own keys
    with pytest.raises(SecAggRejected, match="bad-keys"):
        clients[a].share_keys(forged)
    cts = {v: clients[v].share_keys(reqs[v]) for v in params.nodes}
    with pytest.raises(SecAggRejected, match="wrong-stage"):  # a replayed share-keys message
        clients[a].share_keys(reqs[a])
    for v, c in cts.items():
        server.on_shares(v, c)
    with pytest.raises(SecAggRejected, match="duplicate"):
        server.on_shares(a, cts[a])
    reqs3 = server.masked_input_requests()
    tampered = dict(reqs3[a])
    sender = next(iter(tampered))
    tampered[sender] = tampered[sender][:-1] + bytes([tampered[sender][-1] ^ 1])
    unopened = clients[a].receive_shares(tampered)  # left out and named, not taken
    assert list(unopened) == [sender] and "failed authentication" in unopened[sender]
    assert sender not in clients[a].held and sender in clients[a].maskers  # masks with it, holds none of its shares
    swapped = dict(reqs3[a])  # a ciphertext meant for another receiver, relabelled
    other = next(v for v in params.nodes if v not in (a, sender))
    swapped[sender] = reqs3[other][sender]
    unopened = clients[a].receive_shares(swapped)
    assert list(unopened) == [sender] and "failed authentication" in unopened[sender]


def test_server_rejects_wrong_share_counts_and_bad_vectors():
    params, server, clients, keys = started()
    reqs = server.share_keys_requests()
    a = params.nodes[0]
    cts = clients[a].share_keys(reqs[a])
    with pytest.raises(SecAggRejected, match="wrong-share-count"):
        server.on_shares(a, dict(list(cts.items())[:-1]))
    for v in params.nodes:
        server.on_shares(v, cts if v == a else clients[v].share_keys(reqs[v]))
    server.masked_input_requests()
    for bad in (np.zeros(params.dim, dtype="<u2"), np.zeros(params.dim + 1, dtype="<u4"), np.zeros(params.dim)):
        with pytest.raises(SecAggRejected, match="bad-array"):
            server.add_masked(a, bad)
    with pytest.raises(SecAggRejected, match="unknown-sender"):
        server.add_masked(999, np.zeros(params.dim, dtype="<u4"))
    assert int(server.total.sum()) == 0  # nothing reached the sum


def test_client_never_reveals_both_secrets_of_one_node():
    params = make_params(6, 5, 3)
    result_nodes = params.nodes
    server = SecAggServer(params)
    clients = {}
    for v in result_nodes:
        clients[v], k = SecAggClient.setup(v, params)
        server.on_keys(v, k)
    reqs = server.share_keys_requests()
    for v in result_nodes:
        server.on_shares(v, clients[v].share_keys(reqs[v]))
    reqs = server.masked_input_requests()
    for v in result_nodes:
        clients[v].receive_shares(reqs[v])
        clients[v].mask(torch.zeros(params.dim, dtype=torch.int64))
    a, b = result_nodes[0], result_nodes[1]
    others = [v for v in result_nodes if v not in (a, b)]
    with pytest.raises(SecAggRejected, match="both a survivor and dropped"):
        clients[a].unmask([a, b, *others], [b])
    clients[a].unmask([a, *others], [b])  # b claimed dropped: key share only
    with pytest.raises(SecAggRejected, match="wrong-stage"):  # asking again (now claiming b survived) is refused
        clients[a].unmask([a, b, *others], [])
    with pytest.raises(SecAggRejected, match="cannot be named dropped"):
        clients[b].unmask([*others], [a, b])
    from privacy.secagg import split

    assert "values" not in repr(split(b"secret-bytes", 2, 3)[0])


def test_corrupted_share_is_left_out_or_aborts():
    params = make_params(6, 5, 3)
    liar = params.nodes[0]

    def corrupt(v, shares):
        if v == liar:
            name = next(iter(shares))
            shares[name] = shares[name][:-1] + bytes([shares[name][-1] ^ 0x55])
        return shares

    params, server = _unmask_round(6, 5, 3, corrupt)
    result = server.finish()  # 5 honest shares, t = 3: the bad one is left out
    assert torch.equal(result.total, torch.full((params.dim,), len(params.nodes), dtype=torch.int64))
    assert server.bad_share_holders == {liar} and [h for h, _ in server.left_out] == [liar]  # named (and logged)


def _unmask_round(n, k, t, corrupt):
    """A round of ``n`` nodes adding ones, up to the server's receipt of the unmask replies, each
    passed through ``corrupt(node, shares)`` first."""
    params, server, clients, keys = started(n, k, t)
    reqs = server.share_keys_requests()
    for v in params.nodes:
        server.on_shares(v, clients[v].share_keys(reqs[v]))
    reqs = server.masked_input_requests()
    for v in params.nodes:
        clients[v].receive_shares(reqs[v])
        server.add_masked(v, clients[v].mask(torch.ones(params.dim, dtype=torch.int64)))
    for v, (surv, dropped) in server.unmask_requests().items():
        server.on_unmask(v, corrupt(v, clients[v].unmask(surv, dropped)))
    return params, server


def _unmask_with_liars(n, k, t, liars):
    """Each of ``liars`` flips a byte of every share it hands back for unmasking."""
    return _unmask_round(n, k, t, lambda v, shares: shares if v not in liars else
                         {name: b[:-1] + bytes([b[-1] ^ 0x55]) for name, b in shares.items()})


def test_two_holders_sending_wrong_shares_do_not_abort_a_round_with_enough_right_ones():
    """Both among every owner's first t holders: trying the first t, all, and all but one failed, and
    the round was aborted though 7 or 8 right shares of each owner were in (t = 5)."""
    params = make_params(10, 9, 5)
    liars = set(params.nodes[:2])
    params, server = _unmask_with_liars(10, 9, 5, liars)
    result = server.finish()
    assert torch.equal(result.total, torch.full((params.dim,), 10, dtype=torch.int64))
    assert set(server.bad_share_holders) == liars


@pytest.mark.parametrize("liar_at", range(4))
def test_one_wrong_share_among_t_plus_one_is_told_apart(liar_at):
    """m = t + 1 leaves Berlekamp-Welch no error to correct: each share left out in turn does (the
    first decoder version aborted here, where leave-one-out had recovered)."""
    params = make_params(5, 4, 3)
    liar = params.nodes[liar_at]
    params, server = _unmask_with_liars(5, 4, 3, {liar})
    result = server.finish()
    assert torch.equal(result.total, torch.full((params.dim,), 5, dtype=torch.int64))
    assert server.bad_share_holders == {liar}


def test_too_many_wrong_shares_abort_the_round_with_the_reason():
    params = make_params(6, 5, 3)
    params, server = _unmask_with_liars(6, 5, 3, set(params.nodes[:3]))  # 2 right shares per owner at most
    with pytest.raises(SecAggAborted, match="could not be rebuilt"):
        server.finish()


def test_a_neighbour_whose_shares_cannot_be_opened_costs_only_its_own_shares():
    """Its receivers mask with it, hold none of its shares and are never asked for them; the round
    completes for everyone, from the other holders' shares, and the server names the sender."""
    params, server, clients, keys = started(8, 6, 4)
    reqs = server.share_keys_requests()
    bad = params.nodes[0]
    for v in params.nodes:
        cts = clients[v].share_keys(reqs[v])
        if v == bad:  # two of its ciphertexts tampered after encryption (the right size, failing authentication)
            for u in sorted(cts)[:2]:
                cts[u] = cts[u][:-1] + bytes([cts[u][-1] ^ 1])
        server.on_shares(v, cts)
    reqs = server.masked_input_requests()
    for v in params.nodes:
        unopened = clients[v].receive_shares(reqs[v])
        server.add_masked(v, clients[v].mask(torch.ones(params.dim, dtype=torch.int64)), unopened)
    for v, (surv, dropped) in server.unmask_requests().items():
        assert v in server.unheld and (bad not in surv or bad not in server.unheld[v])
        server.on_unmask(v, clients[v].unmask(surv, dropped))
    result = server.finish()
    assert torch.equal(result.total, torch.full((params.dim,), 8, dtype=torch.int64))
    assert [u for u, _ in server.left_out] == [bad, bad] and sum(bad in u for u in server.unheld.values()) == 2


def test_parameters_are_checked():
    with pytest.raises(PrivacyError, match="k/2 < t"):
        make_params(10, 4, 2)
    with pytest.raises(PrivacyError, match="even"):
        make_params(10, 3, 2)
    with pytest.raises(PrivacyError, match="2\\*\\*bits"):
        make_params(300, 4, 3, bits=8)
    with pytest.raises(PrivacyError):
        SecAggParams.from_fields({"round": 1})
    check_threshold(3, 4)


def test_client_state_round_trips_through_fields():
    params, server, clients, keys = started()
    reqs = server.share_keys_requests()
    a = params.nodes[0]
    clients[a].share_keys(reqs[a])
    back = SecAggClient.from_fields(clients[a].to_fields())
    assert back.stage == "masked-input" and back.peers == clients[a].peers
    assert back.transport == clients[a].transport and len(back.transport) == len(reqs[a]) - 1
    assert back.self_seed == clients[a].self_seed and "secret" not in repr(back) and "seed" not in repr(back)


def test_a_round_with_every_client_saved_and_restored_between_stages_sums_exactly():
    """What clients/secure.py does (state in Context between messages), with a dropout."""
    params = make_params(7, 4, 3)
    server = SecAggServer(params)

    def saved(c: SecAggClient) -> SecAggClient:
        return SecAggClient.from_fields(dict(c.to_fields()))

    clients = {}
    for v in params.nodes:
        c, keys = SecAggClient.setup(v, params)
        clients[v] = saved(c)
        server.on_keys(v, keys)
    for v, keys in server.share_keys_requests().items():
        server.on_shares(v, clients[v].share_keys(keys))
        clients[v] = saved(clients[v])
    gone, plain = params.nodes[3], torch.zeros(params.dim, dtype=torch.int64)
    for v, cts in server.masked_input_requests().items():
        if v == gone:
            continue
        clients[v].receive_shares(cts)
        q = torch.randint(0, params.levels + 1, (params.dim,), generator=torch.Generator().manual_seed(v))
        plain += q
        server.add_masked(v, clients[v].mask(q))
        restored = saved(clients[v])
        assert restored.held == clients[v].held and restored.maskers == clients[v].maskers
        clients[v] = restored
    for v, (surv, drop) in server.unmask_requests().items():
        server.on_unmask(v, clients[v].unmask(surv, drop))
    result = server.finish()
    assert gone not in result.survivors and torch.equal(result.total, plain & 0xFFFFFFFF)


@pytest.mark.parametrize("field, blob", [("peers", b"\x00" * 7), ("transport", b"\x00" * 41),
                                         ("held", b"\x00" * 15), ("held", b"\x00" * 8 + b"\x00\x00\x00\x09" + b"\x00" * 4)])
def test_a_corrupt_saved_state_is_refused(field, blob):
    params, server, clients, keys = started()
    fields = clients[params.nodes[0]].to_fields()
    with pytest.raises(SecAggRejected, match="saved"):
        SecAggClient.from_fields({**fields, field: blob})


def test_a_saved_state_whose_share_keys_do_not_match_its_neighbours_is_refused():
    params, server, clients, keys = started()
    a = params.nodes[0]
    clients[a].share_keys(server.share_keys_requests()[a])
    fields = clients[a].to_fields()
    with pytest.raises(SecAggRejected, match="cover exactly the saved neighbours"):
        SecAggClient.from_fields({**fields, "transport": fields["transport"][:-40]})


def test_node_ids_above_int64_work_like_flowers_uint64_ids():
    params = SecAggParams.create(1, [2**63 + 11 * i for i in range(8)], degree=4, threshold=3, bits=32, clip=1.0, dim=20)
    result, plain, _ = run(params, {"masked-input": {params.nodes[2]}})
    assert torch.equal(result.total, plain) and len(result.survivors) == 7


def _shares_with(monkeypatch, shape):
    """Make the next ``share_keys`` seal shares of another shape (as a malicious client would)."""
    from privacy.secagg import protocol, shamir

    def bad_split(secret, t, n):
        return [shape(s).to_bytes() for s in shamir.split(secret, t, n)]

    monkeypatch.setattr(protocol, "split_bytes", bad_split)


@pytest.mark.parametrize("shape,found", [
    (lambda s: s.__class__(s.x + 40, s.secret_len, s.values), "x-coordinate in 1..5"),  # outside the holders
])
def test_a_neighbours_misshapen_shares_are_left_out_on_receipt_naming_it(monkeypatch, shape, found):
    """A share the holder would later have to hand back (at an x no holder has) is left out when it
    arrives, naming its sender: it never reaches the honest holder's unmask reply."""
    params, server, clients, keys = started(6, 5, 3)
    reqs = server.share_keys_requests()
    liar, honest = params.nodes[0], params.nodes[1]
    with monkeypatch.context() as m:
        _shares_with(m, shape)
        server.on_shares(liar, clients[liar].share_keys(reqs[liar]))
    for v in params.nodes[1:]:
        server.on_shares(v, clients[v].share_keys(reqs[v]))
    reqs = server.masked_input_requests()
    unopened = clients[honest].receive_shares(reqs[honest])
    assert list(unopened) == [liar] and found in unopened[liar] and liar not in clients[honest].held


@pytest.mark.parametrize("forge", [
    lambda ct: ct[:1],  # garbage of any other size than an honest node's sealed shares
    lambda ct: ct + b"\0",
    lambda ct: b"",
    "2 kB shares",  # shares of a 2 kB secret, sealed and encrypted properly
])
def test_share_ciphertexts_of_another_size_are_refused_by_the_server_naming_the_sender(monkeypatch, forge):
    """The server refuses them at share-keys (the sender then drops out of the round like a node that
    never shared), instead of forwarding them to honest receivers, whose decryption would fail and
    whose masked-input stage was then refused, the round aborted, and the blame counted on them."""
    params, server, clients, keys = started(6, 5, 3)
    reqs = server.share_keys_requests()
    liar = params.nodes[0]
    if forge == "2 kB shares":
        with monkeypatch.context() as m:
            _shares_with(m, lambda s: s.__class__(s.x, 2000, np.zeros(667, dtype=np.int64)))
            cts = clients[liar].share_keys(reqs[liar])
    else:
        cts = {v: forge(ct) for v, ct in clients[liar].share_keys(reqs[liar]).items()}
    with pytest.raises(SecAggRejected, match=f"exactly {CIPHERTEXT_BYTES}") as exc:
        server.on_shares(liar, cts)
    assert (exc.value.node_id, exc.value.rule) == (liar, "bad-share")
    for v in params.nodes[1:]:
        server.on_shares(v, clients[v].share_keys(reqs[v]))
    reqs = server.masked_input_requests()
    assert liar not in reqs and all(liar not in r for r in reqs.values())
    for v in params.nodes[1:]:
        clients[v].receive_shares(reqs[v])  # every honest node goes on


def test_a_misshapen_share_in_an_unmask_reply_is_left_out_alone():
    """One share of the wrong size costs the server that share, not the holder's whole answer."""
    params = make_params(6, 5, 3)
    odd = params.nodes[0]

    def corrupt(v, shares):
        if v == odd:
            name = sorted(shares)[0]
            shares[name] = shares[name] + b"\0" * 5000
        return shares

    params, server = _unmask_round(6, 5, 3, corrupt)
    assert odd in server.responders and odd in server.bad_share_holders
    result = server.finish()
    assert torch.equal(result.total, torch.full((params.dim,), len(params.nodes), dtype=torch.int64))




def test_a_client_refuses_to_unmask_with_fewer_than_t_surviving_neighbours():
    """Answering would hand the server key shares of t or more 'dropped' neighbours while too few survive."""
    params, server, clients = masked(6, 5, 4)
    a, b, *rest = params.nodes
    with pytest.raises(SecAggRejected) as info:
        clients[a].unmask([a, b], rest)  # itself and one neighbour survive: 2 < t = 4
    assert info.value.rule == "too-few-neighbours"
    assert clients[rest[0]].unmask([rest[0], *rest[1:], b], [a])  # t survive: answered


def test_a_rebuilt_self_seed_is_checked_against_its_committed_hash(monkeypatch):
    """A combination of t shares that gives another seed (a crafted share does) must not be used: the server
    checks it against the hash each client committed to, then decodes every share instead."""
    import privacy.secagg.protocol as protocol

    real, calls = protocol.combine_values, []

    def wrong_once(*args, **kw):
        calls.append(1)
        secret = real(*args, **kw)
        return bytes([secret[0] ^ 1]) + secret[1:] if len(calls) == 1 else secret

    monkeypatch.setattr(protocol, "combine_values", wrong_once)
    params, server = _unmask_round(6, 5, 3, lambda v, shares: shares)
    result = server.finish()
    assert calls and torch.equal(result.total, torch.full((params.dim,), len(params.nodes), dtype=torch.int64))


# -- refusals a mutation review (helper-53) found untested --------------------------------------------------------
def test_an_unmask_reply_missing_a_share_is_refused():
    def drop_one(v, shares):
        return dict(list(shares.items())[:-1]) if v == 101 else shares
    with pytest.raises(SecAggRejected, match="wrong-share-count"):
        _unmask_round(6, 5, 3, drop_one)


def test_a_masked_value_at_or_above_2_pow_bits_is_refused():
    params, server, _, _ = shared(6, 5, 3, bits=20)
    a = params.nodes[0]
    bad = np.zeros(params.dim, dtype=ring_dtype(20))
    bad[3] = 1 << 20
    with pytest.raises(SecAggRejected, match="below 2\\*\\*20"):
        server.add_masked(a, bad)
    assert int(server.total.sum()) == 0


def _liar_round(monkeypatch, patch):
    params, server, clients, keys = started(6, 5, 3)
    reqs = server.share_keys_requests()
    liar, honest = params.nodes[0], params.nodes[1]
    with monkeypatch.context() as m:
        patch(m)
        server.on_shares(liar, clients[liar].share_keys(reqs[liar]))
    for v in params.nodes[1:]:
        server.on_shares(v, clients[v].share_keys(reqs[v]))
    reqs = server.masked_input_requests()
    return liar, clients[honest], clients[honest].receive_shares(reqs[honest])


def test_sealed_shares_naming_another_sender_are_left_out(monkeypatch):
    real = protocol._seal
    liar, honest, unopened = _liar_round(
        monkeypatch, lambda m: m.setattr(protocol, "_seal", lambda s, r, bs, ss: real(s + 1, r, bs, ss)))
    assert list(unopened) == [liar] and "names other nodes" in unopened[liar] and liar not in honest.held


def test_seed_and_key_shares_at_different_x_are_left_out(monkeypatch):
    real, calls = shamir.split_bytes, []

    def split(secret, t, n):
        out = real(secret, t, n)
        calls.append(1)
        return out if len(calls) % 2 else out[1:] + out[:1]  # key shares rotated: x differs from the seed's
    liar, honest, unopened = _liar_round(monkeypatch, lambda m: m.setattr(protocol, "split_bytes", split))
    assert list(unopened) == [liar] and "one x-coordinate" in unopened[liar] and liar not in honest.held


def test_unmask_naming_a_node_whose_shares_are_not_held_is_refused():
    params, _, clients = masked(6, 5, 3)
    a, rest = params.nodes[0], params.nodes[1:]
    with pytest.raises(SecAggRejected, match="does not hold"):
        clients[a].unmask([a, *rest], [999])
    with pytest.raises(SecAggRejected, match="does not hold"):
        clients[a].unmask([a, *rest, 999], [])
