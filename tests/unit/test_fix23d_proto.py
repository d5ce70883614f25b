"""trial23 #4: the proto comment of ``StageTrace.op`` / ``domain`` lists exactly the operators and
resource domains a trace can carry (scheduler.QUERY_OPERATORS), in execution order."""

import re
from pathlib import Path

from oprag_server.engine.scheduler import QUERY_OPERATORS

PROTO = Path(__file__).resolve().parents[2] / "proto" / "oprag" / "v1" / "oprag.proto"


def _comment(field: str) -> str:
    m = re.search(rf"message StageTrace \{{.*?\b{field} = \d+;\s*//([^\n]*)", PROTO.read_text(), re.S)
    assert m, field
    return m.group(1)


def test_stage_trace_op_comment_lists_the_query_operators_in_order():
    ops = re.findall(r"[a-z]+", _comment("op").split(",")[0])
    assert ops == [s.op for s in QUERY_OPERATORS]


def test_stage_trace_domain_comment_lists_every_domain():
    listed = {d.strip() for d in _comment("domain").split(":", 1)[1].split(",")}
    assert listed == {s.domain for s in QUERY_OPERATORS}
