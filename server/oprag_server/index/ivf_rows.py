"""The background builds' side of :class:`~oprag_server.index.dense.DenseIndex` (issue 13): the locked reads of the
float32 copy that an IVF retraining's thread encodes from (:mod:`.ivf_build`), and the install between requests of a
retraining or an HNSW compaction (:mod:`.hnsw_build`)."""

from __future__ import annotations

import numpy as np


class IvfRows:
    """A mixin of :class:`~oprag_server.index.dense.DenseIndex` (it uses ``_ann``, ``_one``, ``_slot_row``,
    ``_compact_logged``, ``_mut``, ``_vecs``, ``_row_slot``, ``_n``, ``_rows_of``, ``slots`` and ``vectors``). Every
    change of the flat / IVF copy's rows holds ``_mut`` (a remove moves the last row into the removed one's place), so
    a read under it is consistent."""

    def _locked_rows(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(The build's thread) ``(live bool[M], float32[live.sum(), D])`` of int64[M] ``slots`` now: a copy."""
        with self._mut:
            rows = self._rows_of(np.asarray(slots, dtype=np.int64))
            live = rows >= 0
            return live, self._vecs[rows[live]]

    def _locked_slots(self) -> np.ndarray:
        """(The build's thread) int64[n]: the live slots now, in row order (a copy)."""
        with self._mut:
            return self._row_slot[: self._n].copy()

    @property
    def ann_building(self) -> bool | None:
        """None: no background IVF retraining; False: one is running; True: one is done (:meth:`install_ann` it)."""
        return None if self._ann is None else self._ann.building

    def install_ann(self) -> bool:
        """Put a background IVF retraining or HNSW compaction in place (waits for its thread: call it once
        :attr:`ann_building` is True, or to settle); HNSW rows are renumbered to the new graph's ids (a failed
        compaction compacts here instead). :returns: whether one was under way."""
        if self._ann is None or self._ann.building is None:
            return False
        if self._one:
            err = getattr(self._ann._build, "error", None)  # noqa: SLF001
            if self._ann.install_graph() is None:
                self._compact_logged(f"the background compaction failed ({err!r}); this write waited")
            else:
                self._rows_from_ids()
        else:
            self._ann.install(self.slots, self.vectors)
        self._version += 1  # (the structure that picks candidates changed: what is cached by version is redone)
        return True
