"""The hostile-input suite, round 4 (issue 37, the items left): depth and size in text,
GGUF headers, damaged records at the command line, the files that define what a
directory is, stacks of experts of unequal count.

Each CLI case runs the real command in a subprocess through ``Case``
(tests/test_hostile_inputs.py): the one error line and the exit code asserted, no output,
no temporary sibling, sources unchanged. Nothing is timed: depth and size are bounded by
refusing them, and the refusal is what is asserted.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO
from test_hostile_inputs import Case, make_source, write_rule
from test_record_fuzz import _gguf, _gguf_nested_array, _torch_dist

from ckptxform.rules.expr import MAX_DEPTH
from ckptxform.rules.extends import MAX_EXTENDS
from ckptxform.sources.strict_json import MAX_INT_DIGITS


@pytest.fixture
def case(tmp_path: Path, run_cli: Any) -> Case:
    return Case(tmp_path, run_cli)


# ---------------------------------------------------------------- 6: depth and size in text


def _config_set_rule(case: Case, value: str, sources: str = "m: {path: m}") -> Path:
    make_source(case.root / "m", {"w": torch.ones(2)})
    return write_rule(case.root / "r.yaml", f"sources: {{{sources}}}\nconvert: m\ntensors:\n  - match: w\n"
                                            f"config:\n  from: m\n  set:\n    x: '{value}'\n")


NESTED = "is nested too deep (more than 100 levels of parentheses, signs, powers, calls or chained operators); " \
         "split it into config fields"


@pytest.mark.parametrize(("body", "shown"), [
    ("(" * 5000 + "1" + ")" * 5000, "(" * 55),
    ("-" * 5000 + "1", "-" * 55),
    ("2 ** " * 5000 + "1", "2 ** " * 11),
    ("+".join(["1"] * 5000), "1+" * 27 + "1"),
    ("sqrt(" * 3000 + "4" + ")" * 3000, "sqrt(" * 11),
    ("1 ?? " + "[" * 100_000 + "]" * 100_000, "1 ?? " + "[" * 50),
])
def test_an_expression_nested_thousands_deep_is_refused_at_validate(case: Case, body: str, shown: str) -> None:
    assert MAX_DEPTH == 100
    rule = _config_set_rule(case, "${" + body + "}")
    case.fails("validate", rule, code=2, line=f"r.yaml:9:8: config.set.x: '${{{shown}...' {NESTED}")


def test_an_expression_at_the_depth_bound_still_evaluates(case: Case) -> None:
    rule = _config_set_rule(case, "${" + "(" * 99 + "1 + 2" + ")" * 99 + "}")
    proc = case.run_cli("apply", rule, "--out", "out", cwd=case.root)
    assert proc.returncode == 0, proc.stderr
    assert '"x": 3' in (case.out / "config.json").read_text()


def test_a_product_of_literals_past_64_bits_is_refused_not_grown(case: Case) -> None:
    rule = _config_set_rule(case, "${" + " * ".join(["99999999999"] * 90) + "}")
    case.fails("plan", rule, code=1, line=(
        "error: config.set.x (r.yaml:9): '${99999999999 * 99999999999 * 99999999999 * 99999999999 *...': "
        "99999999999 * 99999999999 is a 22-digit integer: number too large (more than 64 bits)"))


def test_a_huge_config_integer_is_refused_where_it_is_read(case: Case) -> None:
    make_source(case.root / "big", {"w": torch.ones(2)}, config='{"hidden_size": ' + "7" * 4000 + "}")
    rule = write_rule(case.root / "r.yaml", "sources: {m: {path: big}}\ntensors:\n  - match: w\nrequire:\n"
                                            "  config:\n    hidden_size: {of: m, below: '${source.m.config.hidden_size "
                                            "** 2}'}\n")
    case.fails("plan", rule, code=1, line=(
        "error: big/config.json: config holds the 4000-digit integer 777777777777777777777...: number too large "
        f"(more than {MAX_INT_DIGITS} digits); fix or remove the file"))


def test_a_config_integer_past_64_bits_is_refused_in_arithmetic(case: Case) -> None:
    make_source(case.root / "big", {"w": torch.ones(2)}, config='{"hidden_size": ' + "7" * 30 + "}")
    rule = write_rule(case.root / "r.yaml", "sources: {m: {path: big}}\ntensors:\n  - match: w\nconfig:\n"
                                            "  from: m\n  set:\n    sq: '${config.hidden_size * 2}'\n")
    case.fails("plan", rule, code=1, line=(
        "error: config.set.sq (r.yaml:8): '${config.hidden_size * 2}': config.hidden_size is a 30-digit integer: "
        "number too large (more than 64 bits)"))


def test_an_extends_chain_of_1500_files_is_refused_at_its_bound(case: Case) -> None:
    for i in range(1500):
        (case.root / f"r{i}.yaml").write_text(f"version: 1\nextends: r{i + 1}.yaml\n")
    case.fails("validate", "r0.yaml", code=2, line=(
        f"r{MAX_EXTENDS - 1}.yaml:2:10: extends: 'r{MAX_EXTENDS}.yaml': the extends chain is longer than "
        f"{MAX_EXTENDS} files (from r0.yaml); fold some of its files into one"))


def test_a_metadata_json_nested_200000_deep_is_named_by_inspect(case: Case) -> None:
    _torch_dist(case.root / "td")
    (case.root / "td" / "iter_0000001" / "metadata.json").write_text("[" * 200_000 + "]" * 200_000)
    case.fails("inspect", "td", code=1, line=(
        "error: td/iter_0000001/metadata.json: Megatron's metadata.json is not valid JSON (nested too deeply); it "
        'names the backend that saved the checkpoint ({"sharded_backend": "torch_dist"}); re-copy it from the '
        "checkpoint"))


@pytest.mark.parametrize(("text", "reason"), [
    ("[" * 100_000 + "]" * 100_000, "is not valid JSON (nested too deeply)"),
    ("[0, " + "5" * 5000 + "]", "holds the 5000-digit integer 555555555555555555555...: number too large "
                                f"(more than {MAX_INT_DIGITS} digits)"),
    ('{"d2t": [0, 1], "t2d": [' + "[" * 100_000 + "]" * 100_000 + "]}", "is not valid JSON (nested too deeply)"),
])
def test_a_vocabulary_json_nested_deep_or_holding_a_huge_integer_is_named(case: Case, text: str,
                                                                          reason: str) -> None:
    from test_review_hostile import vocab_rule

    (case.root / "map.json").write_text(text)
    case.fails("plan", vocab_rule(case, "map.json"), code=1, line=(
        f"error: vocab file 'map.json': its text {reason}; fix: give a list of ints or "
        '{"d2t": [...], "t2d": [...]}'))


# ---------------------------------------------------------------- GGUF headers


def _gguf_numbers(path: Path) -> dict[str, int]:
    """Offsets of a few header fields of the ``_gguf`` stand-in, found by gguf-py's reader."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    base = reader.data.__array_interface__["data"][0]

    def at(part: Any) -> int:
        return int(part.__array_interface__["data"][0] - base)

    ints, tensor = reader.fields["x.ints"], reader.tensors[0].field
    return {"ints.count": at(ints.parts[4]), "a.type": at(tensor.parts[4]), "a.offset": at(tensor.parts[5]),
            "a.n_dims": at(tensor.parts[2]), "a.dim0": at(tensor.parts[3])}


def _patched(path: Path, field: str, value: int, width: int = 8) -> None:
    data = bytearray(path.read_bytes())
    at = _gguf_numbers(path)[field]
    data[at:at + width] = value.to_bytes(width, "little")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("damage", "what"), [
    (lambda p: _patched(p, "ints.count", 2 ** 62),
     "byte 243: the array 'x.ints' says 4,611,686,018,427,387,904 items, but the 493 bytes left hold at most 123"),
    (lambda p: _patched(p, "a.type", 99, 4), "byte 363: tensor 'a.weight' has type id 99, which is no GGML type "
                                            "this gguf-py knows"),
    (lambda p: _patched(p, "a.offset", 8), "byte 371: tensor 'a.weight' starts at data offset 8, not a multiple "
                                          "of the alignment 32"),
    (lambda p: _patched(p, "a.n_dims", 9, 4), "byte 343: tensor 'a.weight' has 9 dimensions (GGUF allows 1-4)"),
    (lambda p: p.write_bytes(_gguf_nested_array(100_000)), "byte 234: 'x.deep' nests arrays more than 16 deep"),
    (lambda p: p.write_bytes(_gguf_nested_array(3, item=13)),
     "byte 70: 'x.deep' is an array of value type 13, which GGUF does not define (0-12)"),
    (lambda p: p.write_bytes(p.read_bytes()[:300]), None),
])
def test_a_damaged_gguf_header_is_one_named_error(case: Case, damage: Any, what: str | None) -> None:
    path = _gguf(case.root / "g")
    damage(path)
    words = what and f"g/m.gguf: not a readable GGUF file ({what}); re-download it"
    if what is None:
        words = "g/m.gguf: not a readable GGUF file (byte 287: the array 'x.nested' says 2 items, but the 13 " \
                "bytes left hold at most 1); re-download it"
    case.fails("inspect", "g/m.gguf", code=1, line=f"error: {words}")


def test_a_gguf_tensor_past_the_end_of_the_file_is_named(case: Case) -> None:
    path = _gguf(case.root / "g")
    _patched(path, "a.dim0", 2 ** 40)
    case.fails("inspect", "g/m.gguf", code=1, line=(
        "error: g/m.gguf: tensor 'a.weight' ends at byte 17592186044896, past the file's 736; it is truncated "
        "(re-download it)"))


def test_a_gguf_tensor_count_larger_than_the_file_can_hold_is_refused_before_reading(case: Case) -> None:
    path = _gguf(case.root / "g")
    data = bytearray(path.read_bytes())
    data[8:16] = struct.pack("<Q", 2 ** 60)
    path.write_bytes(bytes(data))
    proc = case.run_cli("inspect", "g/m.gguf", cwd=case.root)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "the tensor count says 1,152,921,504,606,846,976 tensors" in proc.stderr, proc.stderr


# ---------------------------------------------------------------- 1: files that define what a directory is


def _files_rule(case: Case, source: str, entries: str, match: str = ".*") -> Path:
    return write_rule(case.root / "r.yaml", f"sources: {{m: {{path: {source}}}}}\ntensors:\n  - match: '{match}'\n"
                                            f"files:\n{entries}")


def _dcp_with_files(root: Path) -> Path:
    from test_record_fuzz import _dcp

    _dcp(root)
    (root / "notes.txt").write_text("kept")
    return root


def test_a_glob_never_copies_the_dcp_metadata_and_the_output_reads_as_safetensors(case: Case) -> None:
    _dcp_with_files(case.root / "d")
    rule = _files_rule(case, "d", "  - {glob: '*'}\n", match="a|b")
    proc = case.run_cli("apply", rule, "--out", "out", cwd=case.root)
    assert proc.returncode == 0, proc.stderr
    copied = sorted(p.name for p in case.out.iterdir())
    assert ".metadata" not in copied and "notes.txt" in copied, copied
    shown = case.run_cli("inspect", "out", "--json", cwd=case.root)
    assert shown.returncode == 0 and '"a"' in shown.stdout and ".distcp" not in shown.stdout, shown.stdout


def test_a_glob_over_a_megatron_save_directory_copies_none_of_its_markers(case: Case) -> None:
    _torch_dist(case.root / "td")
    (case.root / "td" / "iter_0000001" / "tokenizer.model").write_bytes(b"spm")
    rule = _files_rule(case, "td", "  - {glob: '**'}\n", match="a|b")
    proc = case.run_cli("apply", rule, "--out", "out", cwd=case.root)
    assert proc.returncode == 0, proc.stderr
    copied = sorted(str(p.relative_to(case.out)) for p in case.out.rglob("*") if p.is_file())
    assert "tokenizer.model" in copied and not {"metadata.json", "common.pt", ".metadata",
                                                "latest_checkpointed_iteration.txt"} & {
        Path(c).name for c in copied}, copied


@pytest.mark.parametrize(("name", "reason"), [
    (".metadata", "the index of a PyTorch DCP checkpoint: the output would read as a DCP checkpoint with no weights"),
    ("model.safetensors.index.json", "the source's weight index, naming the source's shards: the output writes "
                                     "the index of its own"),
    ("latest_checkpointed_iteration.txt", "Megatron's pointer to its latest iteration: the output would read as a "
                                          "Megatron save directory"),
    ("sub/common.pt", "Megatron's run state of a torch_dist checkpoint: the output would read as one"),
    ("metadata.json", "Megatron's marker of a torch_dist checkpoint: the output would read as one"),
    ("adapter_config.json", "a PEFT adapter's config: the output would read as an adapter"),
])
def test_a_literal_request_for_a_defining_file_is_refused_with_the_reason(case: Case, name: str,
                                                                          reason: str) -> None:
    _dcp_with_files(case.root / "d")
    rule = _files_rule(case, "d", f"  - {{glob: '{name}'}}\n", match="a|b")
    case.fails("apply", rule, "--out", "out", code=1, line=(
        f"error: files[0] (r.yaml:6): '{name}' of source 'm' (d) is never copied: it is {reason}; remove the entry"))


def test_a_rename_onto_a_defining_name_is_refused(case: Case) -> None:
    _dcp_with_files(case.root / "d")
    rule = _files_rule(case, "d", "  - {glob: 'notes.txt', rename: 'x/.metadata'}\n", match="a|b")
    case.fails("apply", rule, "--out", "out", code=1, line=(
        "error: files[0] (r.yaml:6): would copy m:'notes.txt' to 'x/.metadata', which is the index of a PyTorch DCP "
        "checkpoint: the output would read as a DCP checkpoint with no weights; rename it to another name"))


# ---------------------------------------------------------------- 2: stacks of one template agree in count


def _experts(root: Path, layers: list[list[str]], names: tuple[str, ...], prefix: str, gate_rows: list[int],
             config: dict[str, int]) -> None:
    import json

    tensors = {}
    for layer, experts in enumerate(layers):
        for e in experts:
            for name in names:
                shape = (4, 6) if name in ("w2", "down_proj") else (6, 4)
                tensors[f"model.layers.{layer}.{prefix}.experts.{e}.{name}.weight"] = torch.ones(shape)
        tensors[f"model.layers.{layer}.{prefix}.gate.weight"] = torch.ones(gate_rows[layer], 4)
    make_source(root, tensors, config=json.dumps({**config, "hidden_size": 4}))


def test_the_issue_s_mixtral_layer_with_a_superscript_where_expert_3_belongs_fails_the_plan(case: Case) -> None:
    _experts(case.root / "m", [["0", "1", "2", "3"], ["0", "1", "2", "³"]], ("w1", "w3", "w2"),
             "block_sparse_moe", [4, 4], {"num_local_experts": 4, "intermediate_size": 6})
    case.fails("apply", "mixtral_legacy_to_fused", "--source", "model=m", "--out", "out", code=1, line=(
        f"error: tensors[0].ops[0] stack ({REPO / 'rules' / 'mixtral_legacy_to_fused.yaml'}:27): incomplete group: "
        "'model.layers.1.block_sparse_moe.experts.3.w1.weight' is missing; stack over {E} needs 0, 1, 2, 3"))


def test_a_qwen_moe_layer_whose_router_agrees_with_its_fewer_experts_fails_naming_the_layer(case: Case) -> None:
    # each layer's count is its own router's rows: layer 1 is complete by its own count
    _experts(case.root / "m", [["0", "1", "2", "3"], ["0", "1", "2"]], ("gate_proj", "up_proj", "down_proj"),
             "mlp", [4, 3], {"moe_intermediate_size": 6})
    case.fails("plan", "qwen2_moe_legacy_to_fused", "--source", "model=m", code=1, line=(
        f"error: tensors[1].ops[0] stack ({REPO / 'rules' / 'qwen2_moe_legacy_to_fused.yaml'}:34): incomplete "
        "group: 'model.layers.1.mlp.experts.3.down_proj.weight' is missing; stack over {E} takes 4 members for "
        "'model.layers.0.mlp.experts.*.down_proj.weight' but 3 for 'model.layers.1.mlp.experts.*.down_proj.weight'; "
        "every instance of the template must have as many"))


def test_a_qwen_moe_layer_with_a_superscript_expert_is_not_stacked(case: Case) -> None:
    _experts(case.root / "m", [["0", "1", "2", "3"], ["0", "1", "2", "³"]], ("gate_proj", "up_proj", "down_proj"),
             "mlp", [4, 3], {"num_experts": 4, "moe_intermediate_size": 6})
    case.fails("plan", "qwen2_moe_legacy_to_fused", "--source", "model=m", code=1, line=(
        f"error: tensors[1].ops[0] stack ({REPO / 'rules' / 'qwen2_moe_legacy_to_fused.yaml'}:34): "
        "'model.layers.1.mlp.experts.³.down_proj.weight' is beyond the 3 members stack over {E} expects (0, 1, 2)"))


def test_a_stack_counted_from_the_largest_index_agrees_across_layers(case: Case) -> None:
    _experts(case.root / "m", [["0", "1", "2", "3"], ["0", "1", "2"]], ("w",), "moe", [4, 3], {})
    rule = write_rule(case.root / "r.yaml", "sources: {m: {path: m}}\ntensors:\n"
                                            "  - key: '{X*}.moe.experts.{E}.w.weight'\n    to: '{X}.moe.w'\n"
                                            "    ops: [{stack: {over: E}}]\n  - match: '.+'\n")
    case.fails("plan", rule, code=1, line=(
        "error: tensors[0].ops[0] stack (r.yaml:6): incomplete group: 'model.layers.1.moe.experts.3.w.weight' is "
        "missing; stack over {E} takes 4 members for 'model.layers.0.moe.experts.*.w.weight' but 3 for "
        "'model.layers.1.moe.experts.*.w.weight'; every instance of the template must have as many"))


# ---------------------------------------------------------------- 5: damaged records at the command line


def _metadata_edit(change: Any) -> Any:
    def damage(root: Path) -> None:
        import pickle

        path = root / ".metadata"
        meta = pickle.loads(path.read_bytes())  # the test's own file, written by dcp.save
        change(meta, min(meta.state_dict_metadata))
        path.write_bytes(pickle.dumps(meta))
    return damage


def _common(value: Any) -> Any:
    def damage(root: Path) -> None:
        import argparse

        torch.save({"args": argparse.Namespace(num_layers=2, hidden_size=4, bad=value), "iteration": 1},
                   root / "common.pt")
    return damage


def _encrypted(member: str) -> Any:
    def damage(root: Path) -> None:
        data = bytearray((root / member).read_bytes())
        for magic, at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):  # the general-purpose flags, bit 0
            start = data.find(magic)
            while start >= 0:
                data[start + at:start + at + 2] = struct.pack("<H", 1)
                start = data.find(magic, start + 4)
        (root / member).write_bytes(bytes(data))
    return damage


def _corrupt_deflate(root: Path) -> None:
    import io
    import zipfile

    with zipfile.ZipFile(root / "common.pt") as archive:
        members = [(info.filename, archive.read(info)) for info in archive.infolist()]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as new:
        for name, data in members:
            new.writestr(name, data, compress_type=zipfile.ZIP_DEFLATED)
    blob = bytearray(out.getvalue())
    name_len, extra_len = struct.unpack("<HH", blob[26:30])
    for at in range(30 + name_len + extra_len, 38 + name_len + extra_len):
        blob[at] ^= 0xFF
    (root / "common.pt").write_bytes(bytes(blob))


def _self_list() -> list[Any]:
    loop: list[Any] = []
    loop.append(loop)
    return loop


_METADATA = "error: td/iter_0000001/.metadata: not a DCP Metadata torch wrote: {}; give the directory dcp.save wrote, " \
            "or save it again"
_COMMON = "error: td/iter_0000001/common.pt: {}; the file is damaged, or fix the argument and save the checkpoint again"
_ARCHIVE = "error: td/iter_0000001/{}: is not {} as torch.save writes it: its member {}; the file is damaged or " \
           "hostile: copy it again from where it was saved"
CHUNKS = "the chunks of tensor 'a' are not a list of chunk records"
DAMAGED_RECORDS = {
    "chunk an int": (_metadata_edit(lambda m, k: setattr(m.state_dict_metadata[k], "chunks", [7])),
                     _METADATA.format(CHUNKS)),
    "chunk a string": (_metadata_edit(lambda m, k: setattr(m.state_dict_metadata[k], "chunks", ["x"])),
                       _METADATA.format(CHUNKS)),
    "chunks a list holding itself": (_metadata_edit(lambda m, k: setattr(m.state_dict_metadata[k], "chunks",
                                                                         _self_list())), _METADATA.format(CHUNKS)),
    "storage entry a string": (
        _metadata_edit(lambda m, k: m.storage_data.__setitem__(next(iter(m.storage_data)), "__0_0.distcp")),
        _METADATA.format("a storage entry (where a chunk is stored) is a str, not torch's record")),
    "key with a lone surrogate": (
        _metadata_edit(lambda m, k: m.state_dict_metadata.__setitem__("\udc80" + k, m.state_dict_metadata.pop(k))),
        _METADATA.format("key '\\udc80a' is not valid UTF-8 text")),
    "common.pt encrypted": (_encrypted("common.pt"), _ARCHIVE.format(
        "common.pt", "Megatron's common.pt", "'common/data.pkl' is marked encrypted, which torch.save never writes")),
    "common.pt corrupt deflate": (_corrupt_deflate, _ARCHIVE.format(
        "common.pt", "Megatron's common.pt", "'common/data.pkl' cannot be read (error: Error -3 while decompressing "
        "data: invalid distance too far back)")),
    "chunk file encrypted": (_encrypted("__0_0.distcp"), "error: td/iter_0000001/__0_0.distcp: tensor 'a', chunk at "
                             "[0, 0]: is not a torch.save'd DCP chunk as torch.save writes it: its member "
                             "'archive/data.pkl' is marked encrypted, which torch.save never writes; the file is "
                             "damaged or hostile: copy it again from where it was saved"),
    "args holding itself": (_common(_self_list()), _COMMON.format(
        "args.bad[0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0] is nested too deep (more than 16 lists, or a list "
        "that holds itself)")),
    "args NaN": (_common(float("nan")), _COMMON.format("args.bad is nan, which a config (JSON) cannot hold")),
    "args inf": (_common(float("-inf")), _COMMON.format("args.bad is -inf, which a config (JSON) cannot hold")),
    "args lone surrogate": (_common("\udc80"), _COMMON.format("args.bad is not valid UTF-8 text")),
}


@pytest.mark.parametrize("command", ["plan", "apply", "inspect"])
@pytest.mark.parametrize("damage", list(DAMAGED_RECORDS))
def test_a_damaged_record_is_one_line_naming_the_file_at_the_command_line(case: Case, damage: str,
                                                                          command: str) -> None:
    change, line = DAMAGED_RECORDS[damage]
    _torch_dist(case.root / "td")
    change(case.root / "td" / "iter_0000001")
    write_rule(case.root / "r.yaml", "sources: {m: {path: td, config: common.pt}}\ntensors:\n  - match: 'a|b'\n"
                                     "config:\n  from: m\n")
    args = {"plan": ("plan", "r.yaml"), "apply": ("apply", "r.yaml", "--out", "out"), "inspect": ("inspect", "td")}
    if command == "inspect" and ".metadata" not in line:
        # inspect lists tensors from .metadata alone: it reads no chunk and no common.pt
        proc = case.run_cli(*args[command], cwd=case.root)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        return
    case.fails(*args[command], code=1, line=line)


# ---------------------------------------------------------------- 10: sparse and inflating records


def _peak_rss_mb(case: Case, *args: str) -> tuple[int, str, float]:
    """Run the command in a fresh interpreter that reports its child's peak memory (MB)."""
    import json
    import subprocess
    import sys

    probe = ("import json, resource, subprocess, sys\n"
             "p = subprocess.run([sys.executable, '-m', 'ckptxform', *sys.argv[1:]], capture_output=True, text=True)\n"
             "print(json.dumps([p.returncode, p.stderr, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))\n")
    proc = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, cwd=case.root,
                          timeout=600)
    code, stderr, peak_kb = json.loads(proc.stdout)
    return code, stderr, peak_kb / 1024


@pytest.mark.parametrize(("start", "words"), [
    (b"", "does not start as a pickle (first bytes b'\\x00\\x00'); a DCP .metadata file is a pickle dcp.save "
          "writes: the file is damaged or is another file (copy the checkpoint again)"),
    (b"\x80\x04\x95", "is not a readable pickle (UnpicklingError: invalid load key, '\\x00'.); a DCP .metadata file "
                      "was truncated or damaged: copy it again from where it was saved"),
])
def test_a_sparse_gigabyte_metadata_is_refused_at_its_first_bytes(case: Case, start: bytes, words: str) -> None:
    from test_record_fuzz import _dcp

    _dcp(case.root / "d")
    with open(case.root / "d" / ".metadata", "r+b") as f:
        f.truncate(0)
        f.write(start)
        f.truncate(1 << 30)  # sparse: no disk, but 1 GiB to whoever reads it whole
    code, stderr, peak = _peak_rss_mb(case, "inspect", "d")
    assert (code, stderr.splitlines()) == (1, [f"error: d/.metadata: {words}"])
    assert peak < 400, peak  # read whole, it took 2 GB


@pytest.mark.parametrize("lies", [False, True])
def test_a_common_pt_inflating_past_its_bound_is_refused_with_memory_bounded(case: Case, lies: bool) -> None:
    import io
    import zipfile

    _torch_dist(case.root / "td")
    path = case.root / "td" / "iter_0000001" / "common.pt"
    with zipfile.ZipFile(path) as archive:
        members = [(info.filename, archive.read(info)) for info in archive.infolist()]
    out = io.BytesIO()
    inflated = 0
    with zipfile.ZipFile(out, "w") as new:
        for name, data in members:
            if name.endswith("data.pkl"):
                data += b"\0" * (512 << 20)  # after the pickle's STOP: 512 MB of zeros, ~0.5 MB deflated
                inflated = len(data)
            new.writestr(name, data, compress_type=zipfile.ZIP_DEFLATED)
    blob = bytearray(out.getvalue())
    if lies:  # every header says the member holds 1,000 bytes
        for magic, at in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
            start = blob.find(magic)
            while start >= 0:
                if struct.unpack("<I", blob[start + at:start + at + 4])[0] == inflated:
                    blob[start + at:start + at + 4] = struct.pack("<I", 1000)
                start = blob.find(magic, start + 4)
    path.write_bytes(bytes(blob))
    assert path.stat().st_size < 2 << 20
    write_rule(case.root / "r.yaml", "sources: {m: {path: td, config: common.pt}}\ntensors:\n  - match: 'a|b'\n"
                                     "config:\n  from: m\n")
    code, stderr, peak = _peak_rss_mb(case, "plan", "r.yaml")
    # a header that lies: zipfile reads no more than it says, and the checksum then fails
    why = "cannot be read (BadZipFile: Bad CRC-32 for file 'common/data.pkl')" if lies else \
        f"claims {inflated:,} bytes, more than the 67,108,864 such a record may hold"
    assert (code, stderr.splitlines()) == (1, [
        f"error: td/iter_0000001/common.pt: is not Megatron's common.pt as torch.save writes it: its member "
        f"'common/data.pkl' {why}; the file is damaged or hostile: copy it again from where it was saved"])
    assert peak < 400, peak


@pytest.mark.parametrize("config", ["  from: m\n", "  set:\n    rope_theta: '${source.m.config.llama.rope.freq_base}'\n"])
def test_a_nan_in_a_gguf_s_metadata_is_refused_at_plan_time_not_at_commit(case: Case, config: str) -> None:
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(case.root / "m.gguf", "llama")
    writer.add_rope_freq_base(float("nan"))
    writer.add_tensor("a.weight", np.ones((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    rule = write_rule(case.root / "r.yaml", f"sources: {{m: {{path: m.gguf}}}}\ntensors:\n  - match: '.+'\n"
                                            f"config:\n{config}")
    field = "llama.rope.freq_base" if "from" in config else "rope_theta"
    case.fails("apply", rule, "--out", "out", code=1, line=(
        f"error: config (r.yaml:6): the written config.json would hold nan at '{field}', which JSON cannot hold; "
        "fix it in the source, or set the field in the rule's config section"))
