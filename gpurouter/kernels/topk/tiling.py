"""The top-k and aux-score plans' one ``tiling`` argument: ``TopkTiling``, the
tilings of their kernel families (``token/tiling.py``, ``lane/tiling.py``,
``bwd_tiling.py``)."""

from __future__ import annotations

import dataclasses

from .bwd_tiling import BWD_TILING, BwdTiling
from .lane.tiling import ROW_TILING, RowTiling
from .token.tiling import TOKEN_TILING, TokenTiling


@dataclasses.dataclass(frozen=True)
class TopkTiling:
    """The tilings of the top-k and aux-score kernel families, one argument of their
    plans (and of the cache key): ``token`` (the thread-per-token forwards), ``row``
    (the W-lane forwards), ``bwd`` (the backwards).  The defaults are the library's."""

    token: TokenTiling = TOKEN_TILING
    row: RowTiling = ROW_TILING
    bwd: BwdTiling = BWD_TILING


#: the library's tilings
TOPK_TILING = TopkTiling()
