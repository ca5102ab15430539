"""The steps of a SecAgg+ round as pure functions: each takes explicit state and messages, returns new ones.

A round with clients 0..n-1 and the neighbour graph of :class:`SecAggParams`:

1. ``advertise``: each client makes two key pairs and sends the public halves.
   The server's ``collect_keys`` gives every client the keys of those who advertised.
2. ``share``: each client draws a self-mask seed b_i, Shamir-shares b_i and its mask
   private key s_i among its neighbours (threshold t) and seals each neighbour's pair of
   shares with a key only the two of them can agree on. ``route_shares`` hands each
   client what was sealed for it; the clients that shared are the round's members.
3. ``masked_input``: each client opens its shares, quantizes its vector and adds
   PRG(b_i) and, for every neighbour j that shared, +PRG(s_ij) when i < j, -PRG(s_ij)
   when i > j. The server sees only masked vectors.
4. ``request_unmask`` names the survivors (masked input received) and the dropped
   (shared but sent no input). In ``unmask`` each survivor returns its share of b_j for
   surviving neighbours and of s_j for dropped ones, never both for one j.
5. ``aggregate`` reconstructs the survivors' b and the dropped clients' s from t shares
   each, removes those masks, and returns the sum mod 2^bits and as floats. Pairwise
   masks between survivors cancel in the sum without anyone's help.

The server learns the sum of the survivors' quantized vectors and who dropped, nothing
else, as long as fewer than t of a client's neighbours collude with it and it follows
the protocol (semi-honest). States are frozen: a caller keeps the newest one and never
reuses an older one, since running ``masked_input`` twice from one state would show the
server the difference of two inputs.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from edge_client.secagg import masking
from edge_client.secagg.errors import MessageError, ParamsError, RefusedError, RoundFailedError, ShareError
from edge_client.secagg.keys import agree, decrypt, encrypt, generate_keypair, pair_info, public_key_of
from edge_client.secagg.messages import (SEALED_BYTES, SEED_BYTES, Advertise, ForwardedShares, MaskedInput,
                                         PublicKeys, SecAggParams, ShareBundle, UnmaskRequest, UnmaskResponse)
from edge_client.secagg.shamir import (PRIME, SHARE_BYTES, point_of, reconstruct, share_from_bytes, share_to_bytes,
                                       split)

__all__ = ["ClientState", "AggregateResult", "advertise", "share", "masked_input", "unmask", "collect_keys",
           "check_share_bundle", "route_shares", "check_masked_input", "MaskedSum", "request_unmask",
           "check_unmask_response", "aggregate"]

_ENCRYPT, _MASK = "encrypt", "mask"
_SELF, _KEY = "self", "key"
_STEPS = ("advertised", "shared", "masked")


@dataclass(frozen=True, repr=False)
class ClientState:
    """What one client keeps through a round; ``repr`` shows no secret."""

    params: SecAggParams
    client_id: int
    c_sk: bytes                                    # seals shares
    s_sk: bytes                                    # seeds pairwise masks; shared among neighbours
    step: str = "advertised"                       # advertised -> shared -> masked
    self_seed: bytes = b""                         # b_i, drawn by share
    peers: Mapping[int, tuple[bytes, bytes]] = field(default_factory=dict)   # neighbours' (c_pk, s_pk)
    held: Mapping[int, tuple[int, int]] = field(default_factory=dict)        # neighbour -> its shares of (b, s)
    revealed: Mapping[int, str] = field(default_factory=dict)                # neighbour -> "self" or "key"

    def __repr__(self) -> str:
        return f"ClientState(round={self.params.round_id}, client={self.client_id}, step={self.step!r})"


@dataclass(frozen=True)
class AggregateResult:
    """The sum over ``survivors``: exact residues mod 2^bits and the float sum they decode to."""

    residues: np.ndarray
    values: np.ndarray
    survivors: tuple[int, ...]


# ----------------------------------------------------------------------------- checks shared by both sides


def _check_round(params: SecAggParams, round_id: int, what: str) -> None:
    if round_id != params.round_id:
        raise MessageError(f"{what} is for round {round_id}, this is round {params.round_id}: a stale or "
                           "misrouted message; drop it")


def _check_ids(params: SecAggParams, ids: Iterable[int], what: str) -> None:
    bad = sorted(i for i in ids if not 0 <= i < params.num_clients)
    if bad:
        raise MessageError(f"{what} names clients {bad}, outside this round's ids 0..{params.num_clients - 1}")


def _check_step(state: ClientState, want: str, action: str) -> None:
    if state.step != want:
        raise RefusedError(f"{action} runs after the {want!r} step, this client is at {state.step!r}: each step "
                           "runs once, in order, from the newest state")


def _associated(round_id: int, sender: int, receiver: int) -> bytes:
    """What a sealed share is bound to, so the server cannot replay it to another client or round."""
    return b"fedge-secagg-v1/shares/" + round_id.to_bytes(8, "big") + sender.to_bytes(4, "big") + \
        receiver.to_bytes(4, "big")


def _channel_key(params: SecAggParams, c_sk: bytes, me: int, peer: int, peer_c_pk: bytes) -> bytes:
    return agree(c_sk, peer_c_pk, pair_info(_ENCRYPT, params.round_id, me, peer))


def _mask_seed(params: SecAggParams, s_sk: bytes, me: int, peer: int, peer_s_pk: bytes) -> bytes:
    return agree(s_sk, peer_s_pk, pair_info(_MASK, params.round_id, me, peer))


# ----------------------------------------------------------------------------- client


def advertise(params: SecAggParams, client_id: int) -> tuple[ClientState, Advertise]:
    """A client's fresh key pairs for the round, and the message with their public halves."""
    _check_ids(params, [client_id], "this client's id")
    c, s = generate_keypair(), generate_keypair()
    return ClientState(params, client_id, c.private, s.private), Advertise(params.round_id, client_id, c.public,
                                                                           s.public)


def share(state: ClientState, keys: PublicKeys) -> tuple[ClientState, ShareBundle]:
    """Shares of b_i and s_i for each neighbour that advertised, each pair sealed for that neighbour alone."""
    _check_step(state, "advertised", "share")
    p, me = state.params, state.client_id
    _check_round(p, keys.round_id, "the public keys")
    _check_ids(p, keys.keys, "the public keys")
    if keys.keys.get(me) != (public_key_of(state.c_sk), public_key_of(state.s_sk)):
        raise MessageError(f"the public keys list other keys for client {me} than it advertised: they were "
                           "altered or belong to another round")
    peers = {j: keys.keys[j] for j in p.neighbours[me] if j in keys.keys}
    if len(peers) < p.threshold:
        raise RefusedError(f"only {len(peers)} of client {me}'s {len(p.neighbours[me])} neighbours advertised "
                           f"keys and its secrets need {p.threshold} to be recovered: the round cannot finish, so "
                           "this client shares nothing")
    self_seed = os.urandom(SEED_BYTES)
    points = [point_of(j) for j in peers]
    pairs = zip(peers, split(self_seed, points, p.threshold), split(state.s_sk, points, p.threshold))
    sealed = {j: encrypt(_channel_key(p, state.c_sk, me, j, peers[j][0]), share_to_bytes(b) + share_to_bytes(s),
                         _associated(p.round_id, me, j))
              for j, b, s in pairs}
    return replace(state, step="shared", self_seed=self_seed, peers=peers), ShareBundle(p.round_id, me, sealed)


def masked_input(state: ClientState, forwarded: ForwardedShares, values: np.ndarray,
                 rng: np.random.Generator | None = None) -> tuple[ClientState, MaskedInput]:
    """The client's vector, quantized (stochastically with ``rng``) and masked, for the server to sum."""
    _check_step(state, "shared", "masked_input")
    p, me = state.params, state.client_id
    _check_round(p, forwarded.round_id, "the forwarded shares")
    if forwarded.receiver != me:
        raise MessageError(f"shares forwarded to client {forwarded.receiver} reached client {me}: misrouted")
    strangers = sorted(set(forwarded.sealed) - set(state.peers))
    if strangers:
        raise MessageError(f"shares came from clients {strangers}, which are not neighbours of client {me} "
                           "that advertised keys")
    if len(forwarded.sealed) < p.threshold:
        raise RefusedError(f"only {len(forwarded.sealed)} neighbours shared with client {me}, fewer than the "
                           f"threshold {p.threshold}: the round cannot finish, so this client sends no input")
    vector = np.asarray(values)
    if vector.shape != (p.length,) or not np.issubdtype(vector.dtype, np.floating) or not np.isfinite(vector).all():
        raise ParamsError(f"the input must be a finite float vector of shape ({p.length},), the round's length; "
                          f"got {vector.dtype} {vector.shape}")
    held = {}
    for j in sorted(forwarded.sealed):
        plain = decrypt(_channel_key(p, state.c_sk, me, j, state.peers[j][0]), forwarded.sealed[j],
                        _associated(p.round_id, j, me))
        if len(plain) != 2 * SHARE_BYTES:
            raise MessageError(f"client {j}'s sealed shares hold {len(plain)} bytes, not {2 * SHARE_BYTES}")
        held[j] = (share_from_bytes(plain[:SHARE_BYTES]), share_from_bytes(plain[SHARE_BYTES:]))
    seeds = {j: _mask_seed(p, state.s_sk, me, j, state.peers[j][1]) for j in held}
    mask = masking.combined_mask(p.length, p.bits, [state.self_seed] + [seeds[j] for j in held if me < j],
                                 [seeds[j] for j in held if j < me])
    quantized = masking.quantize(vector, p.clip, p.scale, p.bits, rng)
    masked = masking.add_mod(quantized, mask, p.bits)
    return (replace(state, step="masked", held=held),
            MaskedInput(p.round_id, me, tuple(held), masking.to_bytes(masked, p.bits)))


def unmask(state: ClientState, request: UnmaskRequest) -> tuple[ClientState, UnmaskResponse]:
    """Shares of b_j for surviving neighbours and of s_j for dropped ones; never both for one j.

    Revealing both would let the server remove every mask from j's input. The check
    spans requests: a repeated request gets the same answer, a contradicting one a refusal.
    """
    _check_step(state, "masked", "unmask")
    p, me = state.params, state.client_id
    _check_round(p, request.round_id, "the unmask request")
    _check_ids(p, [*request.survivors, *request.dropped], "the unmask request")
    survivors, dropped = set(request.survivors), set(request.dropped)
    named = survivors | dropped
    asked = {j: _SELF if j in survivors else _KEY for j in state.held if j in named}
    conflicts = sorted((survivors & dropped) | {j for j in asked if state.revealed.get(j, asked[j]) != asked[j]})
    if conflicts:
        raise RefusedError(f"client {me} is asked for both the self-mask share and the mask-key share of clients "
                           f"{conflicts} (in this request or with an earlier one); together they unmask an input, "
                           "so it answers nothing")
    if me not in survivors:
        raise RefusedError(f"client {me} sent its masked input but the request does not list it as a survivor")
    if len(survivors) < p.threshold:
        raise RefusedError(f"the request lists {len(survivors)} survivors, fewer than the threshold {p.threshold}: "
                           "a sum over so few would say too much about each")
    response = UnmaskResponse(p.round_id, me, {j: state.held[j][0] for j, kind in asked.items() if kind == _SELF},
                              {j: state.held[j][1] for j, kind in asked.items() if kind == _KEY})
    return replace(state, revealed={**state.revealed, **asked}), response


# ----------------------------------------------------------------------------- server


def collect_keys(params: SecAggParams, adverts: Iterable[Advertise]) -> PublicKeys:
    """Every advertising client's keys, for the clients to find their neighbours' in."""
    keys: dict[int, tuple[bytes, bytes]] = {}
    for advert in adverts:
        _check_round(params, advert.round_id, f"client {advert.sender}'s advertisement")
        _check_ids(params, [advert.sender], "an advertisement")
        if advert.sender in keys:
            raise MessageError(f"client {advert.sender} advertised twice; keep its first advertisement")
        keys[advert.sender] = (advert.c_pk, advert.s_pk)
    if len(keys) <= params.threshold:
        raise RoundFailedError(f"only {len(keys)} clients advertised keys; each needs {params.threshold} neighbours "
                               f"that did, so at least {params.threshold + 1} must: start the round again with more "
                               "clients")
    return PublicKeys(params.round_id, keys)


def check_share_bundle(params: SecAggParams, keys: PublicKeys, bundle: ShareBundle) -> None:
    """A bundle must come from a client that advertised and seal shares for exactly its advertised neighbours."""
    _check_round(params, bundle.round_id, f"client {bundle.sender}'s shares")
    if bundle.sender not in keys.keys:
        raise MessageError(f"client {bundle.sender} sent shares without having advertised keys")
    expected = sorted(j for j in params.neighbours[bundle.sender] if j in keys.keys)
    if sorted(bundle.sealed) != expected:
        raise MessageError(f"client {bundle.sender} sealed shares for {sorted(bundle.sealed)}, but its neighbours "
                           f"that advertised are {expected}")
    if any(len(v) != SEALED_BYTES for v in bundle.sealed.values()):
        raise MessageError(f"client {bundle.sender}'s sealed shares must be {SEALED_BYTES} bytes each")


def route_shares(params: SecAggParams, keys: PublicKeys,
                 bundles: Iterable[ShareBundle]) -> dict[int, ForwardedShares]:
    """What each client that shared receives; the keys of the result are the round's members from here on."""
    bundles = list(bundles)
    inbox: dict[int, dict[int, bytes]] = {}
    for bundle in bundles:
        check_share_bundle(params, keys, bundle)
        if bundle.sender in inbox:
            raise MessageError(f"client {bundle.sender} sent shares twice; keep its first bundle")
        inbox[bundle.sender] = {}
    for bundle in bundles:
        for receiver, sealed in bundle.sealed.items():
            if receiver in inbox:
                inbox[receiver][bundle.sender] = sealed
    return {i: ForwardedShares(params.round_id, i, sealed) for i, sealed in sorted(inbox.items())}


def check_masked_input(params: SecAggParams, members: Collection[int], masked: MaskedInput) -> np.ndarray:
    """The vector of a masked input that the server can unmask: from a member, masked with the right neighbours."""
    _check_round(params, masked.round_id, f"client {masked.sender}'s masked input")
    if masked.sender not in members:
        raise MessageError(f"client {masked.sender} sent a masked input without having shared its secrets")
    expected = tuple(j for j in params.neighbours[masked.sender] if j in members)
    if tuple(masked.masked_with) != expected:
        raise MessageError(f"client {masked.sender} masked with {list(masked.masked_with)}, but its neighbours "
                           f"that shared are {list(expected)}: its input could not be unmasked; leave it out")
    return masking.from_bytes(masked.vector, params.length, params.bits)


class MaskedSum:
    """The masked inputs received so far, added as they come: one vector's memory, not one per client.

    A sum of masked vectors is as masked as each of them (the pairwise and self masks only
    cancel, or are removed, once the survivors' secrets are reconstructed), so adding early
    reveals nothing and keeps a round of many clients from holding every vector until unmask."""

    def __init__(self, params: SecAggParams, members: Collection[int]) -> None:
        self.params, self.members = params, frozenset(members)
        self.total = np.zeros(params.length, dtype=masking.word_dtype(params.bits))
        self.senders: set[int] = set()

    def add(self, masked: MaskedInput) -> None:
        """Check ``masked`` (:func:`check_masked_input`, one per client) and add its vector."""
        vector = check_masked_input(self.params, self.members, masked)
        if masked.sender in self.senders:
            raise MessageError(f"client {masked.sender} sent two masked inputs; keep the first")
        self.total = masking.add_mod(self.total, vector, self.params.bits)
        self.senders.add(masked.sender)

    @classmethod
    def of(cls, params: SecAggParams, members: Collection[int], masked: Iterable[MaskedInput] | MaskedSum) -> MaskedSum:
        if isinstance(masked, MaskedSum):
            return masked
        summed = cls(params, members)
        for m in masked:
            summed.add(m)
        return summed


def request_unmask(params: SecAggParams, members: Collection[int],
                   masked: Iterable[MaskedInput] | MaskedSum) -> UnmaskRequest:
    """Who survived (sent a masked input) and who dropped (shared, then sent none)."""
    members = frozenset(members)
    survivors = MaskedSum.of(params, members, masked).senders
    if len(survivors) < params.threshold:
        raise RoundFailedError(f"only {len(survivors)} clients sent masked inputs, fewer than the threshold "
                               f"{params.threshold}: the round fails and no sum is released")
    return UnmaskRequest(params.round_id, tuple(sorted(survivors)), tuple(sorted(members - survivors)))


def check_unmask_response(params: SecAggParams, request: UnmaskRequest, response: UnmaskResponse) -> None:
    """A response must come from a survivor and hold shares only for its neighbours, of the kind asked."""
    _check_round(params, response.round_id, f"client {response.sender}'s unmask response")
    if response.sender not in request.survivors:
        raise MessageError(f"client {response.sender} answered the unmask request without being a survivor")
    mine = set(params.neighbours[response.sender])
    for shares, allowed, what in ((response.self_shares, request.survivors, "self-mask"),
                                  (response.key_shares, request.dropped, "mask-key")):
        stray = sorted(set(shares) - (mine & set(allowed)))
        if stray:
            raise MessageError(f"client {response.sender} sent {what} shares for clients {stray}, which it was not "
                               "asked for")
        if not all(isinstance(v, int) and 0 <= v < PRIME for v in shares.values()):
            raise MessageError(f"client {response.sender}'s {what} shares must be field elements below 2^256 + 297")


def _recover(params: SecAggParams, responses: Mapping[int, UnmaskResponse], target: int, kind: str) -> bytes:
    what = "self-mask seed" if kind == _SELF else "mask key"
    points = [(point_of(r.sender), (r.self_shares if kind == _SELF else r.key_shares)[target])
              for r in responses.values() if target in (r.self_shares if kind == _SELF else r.key_shares)]
    if len(points) < params.threshold:
        raise RoundFailedError(f"only {len(points)} neighbours of client {target} returned a share of its {what}, "
                               f"and {params.threshold} are needed: the round fails and no sum is released; expect "
                               "fewer dropouts or raise the degree")
    try:
        return reconstruct(points, params.threshold)
    except ShareError as exc:
        raise RoundFailedError(f"client {target}'s {what} cannot be reconstructed: {exc}") from None


def aggregate(params: SecAggParams, keys: PublicKeys, request: UnmaskRequest,
              masked: Iterable[MaskedInput] | MaskedSum, responses: Iterable[UnmaskResponse]) -> AggregateResult:
    """The exact sum of the survivors' quantized vectors, with every remaining mask removed.

    Every secret is reconstructed before any mask is removed, so a round that cannot finish
    raises :class:`RoundFailedError` having unmasked nothing.
    """
    _check_round(params, request.round_id, "the unmask request")
    members = set(request.survivors) | set(request.dropped)
    unknown = sorted(members - set(keys.keys))
    if unknown:
        raise MessageError(f"the unmask request names clients {unknown} whose keys are not in the public keys given; "
                           "pass the keys of the same round")
    summed = MaskedSum.of(params, members, masked)
    if sorted(summed.senders) != list(request.survivors):
        raise MessageError("the masked inputs must be those of exactly the survivors named in the unmask request")
    answers: dict[int, UnmaskResponse] = {}
    for r in responses:
        check_unmask_response(params, request, r)
        if r.sender in answers:
            raise MessageError(f"client {r.sender} answered twice; keep its first response")
        answers[r.sender] = r
    self_seeds = [_recover(params, answers, i, _SELF) for i in request.survivors]
    mask_keys = {j: _recover(params, answers, j, _KEY) for j in request.dropped}
    for j, s_sk in mask_keys.items():
        if public_key_of(s_sk) != keys.keys[j][1]:
            raise RoundFailedError(f"client {j}'s reconstructed mask key does not match its advertised public key: "
                                   "a share was altered; the round fails and no sum is released")
    plus, minus = list(self_seeds), []
    for j, s_sk in mask_keys.items():
        for i in params.neighbours[j]:
            if i in summed.senders:   # i added +PRG(s_ij) if i < j, else -PRG(s_ij)
                (plus if i < j else minus).append(_mask_seed(params, s_sk, j, i, keys.keys[i][1]))
    residues = masking.sub_mod(summed.total, masking.combined_mask(params.length, params.bits, plus, minus), params.bits)
    return AggregateResult(residues, masking.dequantize(residues, params.scale, params.bits), request.survivors)
