"""``python -m ckptxform.ops``: write the registry's op schemas into schemas/rules.schema.json.

After adding or changing an op, run it from a checkout: the file keeps ``$defs.op`` one
line per verb, so editors complete the new verb (tests/test_structural_rules.py checks
that the file and the registry agree).
"""

from __future__ import annotations

import json

from .._data import data_dir
from . import ops_schema


def write_schema_ops() -> None:
    path = data_dir("schemas") / "rules.schema.json"
    text = path.read_text("utf-8")
    start = text.index('    "op": {\n')
    end = text.index('\n    "', start) + 1  # the next $defs entry, whichever it is
    schema = ops_schema()
    verbs = schema.pop("properties")
    lines = [f"        {json.dumps(verb)}: {json.dumps(fragment, ensure_ascii=False)}" for verb, fragment in verbs.items()]
    block = '    "op": {\n      ' + json.dumps(schema)[1:-1] + ',\n      "properties": {\n' + ",\n".join(lines)
    text = text[:start] + block + "\n      }\n    },\n" + text[end:]
    json.loads(text)  # still one JSON document
    path.write_text(text, "utf-8")
    print(f"wrote {len(verbs)} ops into {path}")


if __name__ == "__main__":
    write_schema_ops()
