"""The scheduler's side of the handshake: every launched rank's HELLO, checked against the launch and
against rank 0's, then the protocol version every side speaks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from protocol.conversation.common import check_handshake_envelope
from protocol.conversation.scheduler_events import HandshakeComplete, HandshakeRefused
from protocol.errors import ProtocolError, RejectCode
from protocol.frames import Frame, Hello
from protocol.validate import check_geometry, negotiate_version


class PlannedGeometry(Protocol):
    """What the scheduler plans with (scheduler.SchedulerConfig has these): every rank's cache must
    agree, or the scheduler would plan pages and lengths the executors do not have."""

    num_kv_pages: int
    page_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_host_pages: int


PLANNED_FIELDS = ("num_kv_pages", "page_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_host_pages")


class Handshake:
    """The HELLOs heard so far, by rank. Each is checked against the launch (its rank, world size,
    layout, versions and the planned geometry) and, once rank 0's is in, against rank 0's (config and
    model fingerprints, the whole cache geometry); the first that fails refuses the handshake."""

    def __init__(
        self,
        *,
        world_size: int,
        run_id: str,
        planned: PlannedGeometry | None,
        supported_versions: Sequence[int],
        layout: int,
    ) -> None:
        self.world_size = world_size
        self.run_id = run_id
        self.supported_versions = supported_versions
        self.layout = layout
        self._planned = planned
        self.hellos: dict[int, Hello] = {}

    def host(self, rank: int) -> str:
        hello = self.hellos.get(rank)
        return hello.host if hello is not None and hello.host else "?"

    def who(self, rank: int) -> str:
        """How errors name a rank: with its host, once its HELLO said which."""
        return f"rank {rank} on host {self.host(rank)}"

    def add(self, rank: int, frame: Frame) -> HandshakeComplete | HandshakeRefused | None:
        """Rank `rank`'s first HELLO (the caller has checked it is one, and its first): the outcome
        once it settles the handshake, None while HELLOs are still missing."""
        hello = frame.body
        self.hellos[rank] = hello
        try:
            check_handshake_envelope(frame, self.supported_versions, self.layout, self.run_id)
            self._check_hello(rank, hello)
        except ProtocolError as exc:
            return self._refuse(rank, exc.code, f"{self.who(rank)}: {exc.message}")
        if 0 in self.hellos:
            for other in [rank] if rank != 0 else sorted(self.hellos)[1:]:
                try:
                    self._check_against_rank0(other, self.hellos[other])
                except ProtocolError as exc:
                    return self._refuse(other, exc.code, exc.message)
        if len(self.hellos) < self.world_size:
            return None
        return self._agree(rank)

    def _agree(self, last: int) -> HandshakeComplete | HandshakeRefused:
        """Every HELLO is in and consistent: the highest version all of them and the scheduler speak.
        With none, the rank whose HELLO came last is named, the list of offers says the rest."""
        common = set(self.supported_versions).intersection(*(h.versions for h in self.hellos.values()))
        try:
            version = negotiate_version(common)
        except ProtocolError:
            offers = ", ".join(f"{self.who(r)} {list(h.versions)}" for r, h in sorted(self.hellos.items()))
            return self._refuse(last, RejectCode.BAD_VERSION, (
                f"no protocol version is common to every rank and the scheduler ({list(self.supported_versions)}): {offers}"))
        return HandshakeComplete(version, self.hellos[0].geometry, tuple(self.hellos[r] for r in range(self.world_size)))

    def _refuse(self, rank: int, code: RejectCode, message: str) -> HandshakeRefused:
        return HandshakeRefused(rank, self.host(rank), code, message)

    def _check_hello(self, rank: int, hello: Hello) -> None:
        if hello.rank != rank:
            raise ProtocolError(RejectCode.MALFORMED, f"its connection is rank {rank}'s, but its HELLO says rank {hello.rank}")
        if hello.world_size != self.world_size:
            raise ProtocolError(
                RejectCode.GEOMETRY_MISMATCH, f"runs with world size {hello.world_size}, this launch has {self.world_size}"
            )
        if hello.layout != self.layout:
            raise ProtocolError(RejectCode.BAD_LAYOUT, f"uses cache layout {hello.layout}, the scheduler {self.layout}")
        if not set(hello.versions) & set(self.supported_versions):
            raise ProtocolError(
                RejectCode.BAD_VERSION,
                f"speaks protocol versions {list(hello.versions)}, the scheduler {list(self.supported_versions)}",
            )
        if self._planned is not None:
            for name in PLANNED_FIELDS:
                have, planned = getattr(hello.geometry, name), getattr(self._planned, name)
                if have != planned:
                    raise ProtocolError(
                        RejectCode.GEOMETRY_MISMATCH,
                        f"was started with other options than the scheduler: its cache has {name} {have}, the "
                        f"scheduler plans with {planned}; every host must be given the same model and options",
                    )

    def _check_against_rank0(self, rank: int, hello: Hello) -> None:
        first = self.hellos[0]
        if hello.config_fingerprint != first.config_fingerprint:
            raise ProtocolError(
                RejectCode.GEOMETRY_MISMATCH,
                f"{self.who(rank)} was started with other options (fingerprint {hello.config_fingerprint}) than "
                f"{self.who(0)} ({first.config_fingerprint}): every host must be given the same model and options",
            )
        if hello.model_fingerprint != first.model_fingerprint:
            raise ProtocolError(
                RejectCode.GEOMETRY_MISMATCH,
                f"{self.who(rank)} loaded other weights (fingerprint {hello.model_fingerprint}) than {self.who(0)} "
                f"({first.model_fingerprint})",
            )
        check_geometry(first.geometry, hello.geometry, who=f"{self.who(rank)} (compared with rank 0)")
