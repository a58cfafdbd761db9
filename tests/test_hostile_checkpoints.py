"""Hostile checkpoint folders and weight maps fed to the reference loader (issue 34).

``weight_loader.load_weights`` binds checkpoints downloaded from the internet, so every case here ends
in one ``KadaptError`` naming the file (and tensor or key) - never a read outside the folder, a hang
on a FIFO, a tensor cast into a wrong weight, or a raw exception. The tiny checkpoint holds every
storage format the weight map describes (dense, stacked experts, a chunked and rope-permuted fused
tensor, int4 pack-quantized, FP8 block-scaled, MXFP4, DeepSeek-V4's FP4 experts with e8m0 scales) in
two shards with an index; data-driven cases live in ``tests/hostile/checkpoints/`` (see its README),
the rest need a filesystem shape built here.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures.checkpoints import fp8_quantized, int4_quantized
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from kimi_adapter_core.checkpoint.guard import DTYPES
from kimi_adapter_core.checkpoint.loader import load_weights
from kimi_adapter_core.checkpoint.storage import fp4_e2m1, fp8_block, mxfp4, pack_quantized
from kimi_adapter_core.errors import KadaptError

REPO = Path(__file__).resolve().parents[1]
CASES = REPO / "tests" / "hostile" / "checkpoints"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
INDEX = "model.safetensors.index.json"

Shards = dict[str, dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Base:
    """The valid tiny checkpoint: its weight map, shard contents, folder and the weights it must give."""

    doc: dict[str, Any]
    shards: Shards
    folder: Path
    expected: dict[str, torch.Tensor]


def _group(tensors: list[str], shape: list[int], storage: dict[str, Any] | None = None) -> dict[str, Any]:
    group: dict[str, Any] = {"tensors": tensors, "shape": shape, "dtype": "float32"}
    if storage is not None:
        group["storage"] = storage
    return group


def _entry(shape: list[int], sources: list[dict[str, Any]], ops: list[dict[str, Any]]) -> dict[str, Any]:
    return {"shape": shape, "dtype": "float32", "sources": sources, "ops": ops}


def _weight_map() -> dict[str, Any]:
    """A weight map as kadapt writes it, storage blocks from kadapt's own builders."""
    doc = {
        "format": "kadapt-weight-map",
        "version": 1,
        "weights": {
            "dense.weight": _entry([4, 6], [_group(["dense.weight"], [4, 6])], []),
            "experts.gate_up": _entry(
                [2, 6, 4],
                [_group(["experts.0.w", "experts.1.w"], [4, 6])],
                [{"op": "stack", "dim": 0}, {"op": "transpose", "dims": [1, 2]}],
            ),
            "q.weight": _entry(
                [8, 6],
                [_group(["wqkv.weight"], [24, 6])],
                [
                    {"op": "chunk", "dim": 0, "chunks": 3, "index": 0},
                    {"op": "permute_for_rope", "heads": 2, "inverse": False},
                ],
            ),
            "int4.weight": _entry(
                [4, 64], [_group(["int4.weight"], [4, 64], pack_quantized((4, 64), 4, 32, "bfloat16"))], []
            ),
            "fp8.weight": _entry([8, 32], [_group(["fp8.weight"], [8, 32], fp8_block((8, 32), (4, 16)))], []),
            "mx.gate_up_proj": _entry(
                [2, 32, 4], [_group(["mx.gate_up_proj"], [2, 32, 4], mxfp4((2, 32, 4)))], []
            ),
            "fp4.weight": _entry(
                [4, 64], [_group(["fp4.weight"], [4, 64], fp4_e2m1((4, 64), "float8_e8m0fnu"))], []
            ),
        },
    }
    return json.loads(json.dumps(doc))  # the builders share their blocks: never mutate those


def _tensors() -> tuple[Shards, dict[str, torch.Tensor]]:
    """(shard name -> tensors, graph weight -> the value it must load as), expected values computed
    independently of the loader (transformers' own MXFP4 and FP8/FP4 dequantizers, the fixtures'
    quantizers)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    dense, e0, e1 = (torch.randn(4, 6, generator=gen) for _ in range(3))
    wqkv = torch.randn(24, 6, generator=gen)
    int4, int4_stored = int4_quantized(torch.randn(4, 64, generator=gen), 32)
    fp8_scale = torch.rand(2, 2, generator=gen) + 0.5
    fp8_stored, fp8 = fp8_quantized(torch.randn(8, 32, generator=gen), fp8_scale, (4, 16))
    blocks = torch.randint(0, 256, (2, 4, 1, 16), generator=gen).to(torch.uint8)
    scales = torch.randint(122, 129, (2, 4, 1), generator=gen).to(torch.uint8)
    fp4_codes = torch.randint(-128, 128, (4, 32), generator=gen).to(torch.int8)
    fp4_scale = torch.exp2(torch.randint(-3, 3, (4, 2), generator=gen).float()).to(torch.float8_e8m0fnu)
    shards = {
        SHARDS[0]: {"dense.weight": dense, "experts.0.w": e0, "experts.1.w": e1, "wqkv.weight": wqkv},
        SHARDS[1]: {
            **{"int4.weight" + suffix: t for suffix, t in int4_stored.items()},
            "fp8.weight": fp8_stored,
            "fp8.weight_scale_inv": fp8_scale,
            "mx.gate_up_proj_blocks": blocks,
            "mx.gate_up_proj_scales": scales,
            "fp4.weight": fp4_codes,
            "fp4.weight_scale_inv": fp4_scale,
        },
    }
    expected = {
        "dense.weight": dense,
        "experts.gate_up": torch.stack([e0, e1]).transpose(1, 2),
        "q.weight": wqkv[:8].reshape(2, 2, 2, 6).transpose(1, 2).reshape(8, 6),  # pairs -> halves per head
        "int4.weight": int4,
        "fp8.weight": fp8,
        "mx.gate_up_proj": convert_moe_packed_tensors(blocks, scales, dtype=torch.float32),
        "fp4.weight": Fp8Dequantize(None)._dequantize_one(fp4_codes, fp4_scale, torch.float32),
    }
    return shards, expected


def _write(folder: Path, shards: Shards, *, index: bool = True) -> Path:
    """``shards`` saved into ``folder`` (created), with the index transformers writes when ``index``."""
    folder.mkdir(parents=True)
    for file, tensors in shards.items():
        save_file(
            {n: t.contiguous() for n, t in tensors.items()}, str(folder / file), metadata={"format": "pt"}
        )
    if index:
        names = {name: file for file, tensors in shards.items() for name in tensors}
        (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": names}))
    return folder


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Base:
    shards, expected = _tensors()
    return Base(_weight_map(), shards, _write(tmp_path_factory.mktemp("base") / "ckpt", shards), expected)


def _refused(weight_map: dict[str, Any] | Path, folder: Path, *parts: str) -> str:
    """The one KadaptError ``load_weights`` raises, checked to contain every one of ``parts``."""
    with pytest.raises(KadaptError) as caught:
        load_weights(weight_map, folder)
    message = str(caught.value)
    for part in parts:
        assert part in message, message
    return message


def _assert_loads(base: Base, weight_map: dict[str, Any] | Path, folder: Path) -> None:
    weights = load_weights(weight_map, folder)
    assert set(weights) == set(base.expected)
    for name, tensor in base.expected.items():
        assert weights[name].dtype == torch.float32 and torch.equal(weights[name], tensor), name


def _replaced(shards: Shards, name: str, tensor: torch.Tensor | None) -> Shards:
    """``shards`` with tensor ``name`` stored as ``tensor`` (None: dropped), in the same shard."""
    return {
        file: {n: (tensor if n == name else t) for n, t in tensors.items() if n != name or tensor is not None}
        for file, tensors in shards.items()
    }


def _outside_copy(base: Base, tmp_path: Path) -> Path:
    """A real shard of the checkpoint, outside its folder (what an escaping path would reach)."""
    (tmp_path / "elsewhere").mkdir()
    return Path(shutil.copy(base.folder / SHARDS[0], tmp_path / "elsewhere" / SHARDS[0]))


def _with_index(folder: Path, shards: Shards, file_of: dict[str, str]) -> None:
    """An index naming ``file_of[shard]`` for every tensor of that shard."""
    names = {name: file_of[file] for file, tensors in shards.items() for name in tensors}
    (folder / INDEX).write_text(json.dumps({"weight_map": names}))


# ---------------------------------------------------------------- good input


def test_the_valid_checkpoint_loads_every_format_by_index_by_glob_and_by_map_file(
    base: Base, tmp_path: Path
) -> None:
    _assert_loads(base, base.doc, base.folder)
    (tmp_path / "map.json").write_text(json.dumps(base.doc))
    _assert_loads(base, tmp_path / "map.json", base.folder)
    _assert_loads(base, base.doc, _write(tmp_path / "globbed", base.shards, index=False))


def test_symlinks_that_stay_inside_the_folder_are_followed(base: Base, tmp_path: Path) -> None:
    folder = _write(tmp_path / "ckpt" / "real", base.shards).parent
    for file in (*SHARDS, INDEX):
        (folder / file).symlink_to(Path("real") / file)
    _assert_loads(base, base.doc, folder)


def _hub_snapshot(base: Base, hub: Path, repo: str, blobs_of: str) -> Path:
    """The Hugging Face cache layout: ``<repo>/snapshots/<rev>/<file>`` symlinked into
    ``<blobs_of>/blobs/<hash>`` (the same repository's, unless the test says otherwise)."""
    blobs = hub / blobs_of / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot = hub / repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for i, file in enumerate((*SHARDS, INDEX)):
        shutil.copy(base.folder / file, blobs / f"blob{i}")
        (snapshot / file).symlink_to(os.path.relpath(blobs / f"blob{i}", snapshot))
    return snapshot


def test_a_hub_cache_snapshot_loads_but_not_from_another_repositorys_blobs(
    base: Base, tmp_path: Path
) -> None:
    _assert_loads(base, base.doc, _hub_snapshot(base, tmp_path, "models--org--tiny", "models--org--tiny"))
    snapshot = _hub_snapshot(base, tmp_path, "models--org--evil", "models--org--other")
    _refused(
        base.doc,
        snapshot,
        "index 'model.safetensors.index.json' resolves to",
        "outside the checkpoint folder",
    )


# ---------------------------------------------------------------- confinement


@pytest.mark.parametrize("case", sorted(json.loads((CASES / "indexes" / "expected.json").read_text())))
def test_hostile_index(case: str, base: Base, tmp_path: Path) -> None:
    """Each file of tests/hostile/checkpoints/indexes/ as the index of a copy of the checkpoint."""
    expected = json.loads((CASES / "indexes" / "expected.json").read_text())[case]
    _outside_copy(base, tmp_path)
    shutil.copy(base.folder / SHARDS[0], tmp_path / "outside.safetensors")  # what ../ would reach
    folder = _write(tmp_path / "ckpt", base.shards, index=False)
    (folder / INDEX).write_bytes((CASES / "indexes" / case).read_bytes())
    _refused(base.doc, folder, str(folder), *expected)


def test_every_index_case_file_has_its_expected_outcome() -> None:
    files = {p.name for p in (CASES / "indexes").iterdir()} - {"expected.json"}
    assert files == set(json.loads((CASES / "indexes" / "expected.json").read_text()))


def test_an_index_nested_past_the_recursion_limit_is_one_error(base: Base, tmp_path: Path) -> None:
    folder = _write(tmp_path / "ckpt", base.shards, index=False)
    (folder / INDEX).write_text("[" * 100_000 + "]" * 100_000)
    _refused(base.doc, folder, f"{folder / INDEX}: not a readable checkpoint index", "recursion")


@pytest.mark.parametrize("index", [True, False], ids=["indexed", "globbed"])
def test_a_shard_symlinked_outside_the_folder_is_refused(index: bool, base: Base, tmp_path: Path) -> None:
    outside = _outside_copy(base, tmp_path)
    folder = _write(tmp_path / "ckpt", {SHARDS[1]: base.shards[SHARDS[1]]}, index=False)
    (folder / SHARDS[0]).symlink_to(outside)
    if index:
        _with_index(folder, base.shards, {f: f for f in SHARDS})
    _refused(
        base.doc, folder, f"shard '{SHARDS[0]}' resolves to {outside}, outside the checkpoint folder {folder}"
    )


def test_an_absolute_shard_path_is_refused_even_to_a_real_checkpoint_file(base: Base, tmp_path: Path) -> None:
    outside = _outside_copy(base, tmp_path)
    folder = _write(tmp_path / "ckpt", {SHARDS[1]: base.shards[SHARDS[1]]}, index=False)
    _with_index(folder, base.shards, {SHARDS[0]: str(outside), SHARDS[1]: SHARDS[1]})
    _refused(base.doc, folder, f"{folder / INDEX}: shard '{outside}' resolves to {outside}, outside")


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda p: p.symlink_to("/dev/zero"), "resolves to /dev/zero, outside the checkpoint folder"),
        (lambda p: p.mkdir(), "is not a regular file (a folder, FIFO or device is never opened)"),
        (lambda p: p.symlink_to(p.with_name("absent.bin")), "does not exist"),
        (lambda p: (p.symlink_to("odd.loop"), p.with_name("odd.loop").symlink_to(p.name)), "cannot be read"),
    ],
    ids=["dev-zero", "folder", "dangling", "loop"],
)
def test_a_globbed_shard_that_is_no_regular_file_inside_is_refused(
    make: Any, expected: str, base: Base, tmp_path: Path
) -> None:
    folder = _write(tmp_path / "ckpt", base.shards, index=False)
    make(folder / "odd.safetensors")
    _refused(base.doc, folder, f"{folder}: shard 'odd.safetensors'", expected)


def test_a_checkpoint_folder_must_be_a_folder(base: Base, tmp_path: Path) -> None:
    _refused(base.doc, base.folder / SHARDS[0], "this is not a folder")
    _refused(base.doc, tmp_path / "missing", f"{tmp_path / 'missing'}: cannot read the checkpoint folder")


# Run in a child process with a timeout: a loader that opens a FIFO blocks forever, and the test must
# then fail, not hang the suite.
_FIFO_CHILD = """
import json, sys
from kimi_adapter_core.checkpoint.loader import load_weights
from kimi_adapter_core.errors import KadaptError
for weight_map, folder in json.loads(sys.argv[1]):
    try:
        load_weights(weight_map, folder)
        print("loaded")
    except KadaptError as exc:
        print(str(exc).replace("\\n", " "))
"""


def test_fifos_are_never_opened(base: Base, tmp_path: Path) -> None:
    indexed = _write(tmp_path / "indexed", base.shards)
    os.mkfifo(indexed / "fifo.safetensors")
    _with_index(indexed, base.shards, {SHARDS[0]: "fifo.safetensors", SHARDS[1]: SHARDS[1]})
    globbed = _write(tmp_path / "globbed", base.shards, index=False)
    os.mkfifo(globbed / "fifo.safetensors")
    fifo_index = _write(tmp_path / "fifo_index", base.shards, index=False)
    os.mkfifo(fifo_index / INDEX)
    (tmp_path / "map.json").write_text(json.dumps(base.doc))
    os.mkfifo(tmp_path / "fifo_map.json")
    cases = [
        (str(tmp_path / "map.json"), str(indexed)),
        (str(tmp_path / "map.json"), str(globbed)),
        (str(tmp_path / "map.json"), str(fifo_index)),
        (str(tmp_path / "fifo_map.json"), str(base.folder)),
    ]
    try:
        done = subprocess.run(
            [sys.executable, "-c", _FIFO_CHILD, json.dumps(cases)],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("load_weights blocked on a FIFO")
    assert done.returncode == 0, done.stderr
    never = "is not a regular file (a folder, FIFO or device is never opened)"
    assert done.stdout.splitlines() == [
        f"{indexed / INDEX}: shard 'fifo.safetensors' {never}",
        f"{globbed}: shard 'fifo.safetensors' {never}",
        f"{fifo_index}: index '{INDEX}' {never}",
        f"{tmp_path / 'fifo_map.json'}: the weight map {never}",
    ]


# ---------------------------------------------------------------- integrity


def _int4_scale_grouped_16() -> torch.Tensor:
    """An int4 scale of the same weight size quantized in groups of 16 (the map says 32)."""
    return int4_quantized(torch.randn(4, 64, generator=torch.Generator().manual_seed(1)), 16)[1]["_scale"]


@pytest.mark.parametrize(
    ("name", "stored", "found", "wanted"),
    [
        ("dense.weight", lambda t: t.to(torch.int32), "int32 [4, 6]", "float32 [4, 6]"),
        ("dense.weight", lambda t: t > 0, "bool [4, 6]", "float32 [4, 6]"),
        ("dense.weight", lambda t: t.double(), "float64 [4, 6]", "float32 [4, 6]"),
        ("dense.weight", lambda t: t.T, "float32 [6, 4]", "float32 [4, 6]"),
        ("experts.1.w", lambda t: t[:3], "float32 [3, 6]", "float32 [4, 6]"),
        ("int4.weight_scale", lambda t: _int4_scale_grouped_16(), "bfloat16 [4, 4]", "bfloat16 [4, 2]"),
        ("int4.weight_packed", lambda t: t.to(torch.int64), "int64 [4, 8]", "int32 [4, 8]"),
        ("fp8.weight", lambda t: t.to(torch.bfloat16), "bfloat16 [8, 32]", "float8_e4m3fn [8, 32]"),
        ("fp8.weight_scale_inv", lambda t: t[:1], "float32 [1, 2]", "float32 [2, 2]"),
        ("mx.gate_up_proj_blocks", lambda t: t.to(torch.int8), "int8 [2, 4, 1, 16]", "uint8 [2, 4, 1, 16]"),
        ("mx.gate_up_proj_scales", lambda t: t[:, :2], "uint8 [2, 2, 1]", "uint8 [2, 4, 1]"),
    ],
    ids=[
        "int32-for-float32", "bool-for-float32", "f64-for-float32", "transposed",
        "short-expert", "int4-grouped-16-read-as-32", "int4-packed-int64", "fp8-weight-bf16",
        "fp8-scale-grid", "mxfp4-blocks-int8", "mxfp4-scales-shape",
    ],
)  # fmt: skip
def test_a_stored_tensor_unlike_the_map_is_refused_not_cast(
    name: str, stored: Any, found: str, wanted: str, base: Base, tmp_path: Path
) -> None:
    file = next(f for f, tensors in base.shards.items() if name in tensors)
    folder = _write(tmp_path / "ckpt", _replaced(base.shards, name, stored(base.shards[file][name])))
    _refused(
        base.doc, folder, f"{folder / file}: tensor {name} is stored {found}, the weight map says {wanted}"
    )


@pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_a_tensor_stored_narrower_widens_exactly_as_transformers_loads_it(
    narrow: torch.dtype, base: Base, tmp_path: Path
) -> None:
    """A float stored in a narrower float than the map says is read as its exact value (transformers'
    loader does the same for a parameter its dtype plan keeps float32); nothing else is cast."""
    file = next(f for f, tensors in base.shards.items() if "dense.weight" in tensors)
    stored = base.shards[file]["dense.weight"].to(narrow)
    folder = _write(tmp_path / "ckpt", _replaced(base.shards, "dense.weight", stored))
    loaded = load_weights(base.doc, folder)["dense.weight"]
    assert loaded.dtype == torch.float32 and torch.equal(loaded, stored.float())


def test_int4_shape_values_unlike_the_map_are_refused(base: Base, tmp_path: Path) -> None:
    folder = _write(tmp_path / "ckpt", _replaced(base.shards, "int4.weight_shape", torch.tensor([4, 32])))
    _refused(
        base.doc,
        folder,
        f"{folder / SHARDS[1]}: tensor int4.weight_shape holds [4, 32], the weight map says [4, 64]",
    )


def test_a_tensor_in_two_globbed_shards_is_ambiguous(base: Base, tmp_path: Path) -> None:
    shards = copy.copy(base.shards)
    shards[SHARDS[1]] = {**shards[SHARDS[1]], "dense.weight": torch.zeros(4, 6)}
    folder = _write(tmp_path / "ckpt", shards, index=False)
    _refused(
        base.doc, folder, f"tensor dense.weight is in both {folder / SHARDS[0]} and {folder / SHARDS[1]}"
    )


def test_names_transformers_accepts_load_the_same_weights(base: Base, tmp_path: Path) -> None:
    """A checkpoint of the base model (names without the map's ``base_model_prefix``) whose FP8 scales
    are named as DeepSeek-V4-Flash ships them (``X.scale``) loads the same weights."""
    doc = copy.deepcopy(base.doc)
    doc["base_model_prefix"] = "model"
    for entry in doc["weights"].values():
        for group in entry["sources"]:
            group["tensors"] = [f"model.{name}" for name in group["tensors"]]
    renamed = {"fp8.weight_scale_inv": "fp8.scale", "fp4.weight_scale_inv": "fp4.qscale_weight"}
    shards = {f: {renamed.get(n, n): t for n, t in ts.items()} for f, ts in base.shards.items()}
    _assert_loads(base, doc, _write(tmp_path / "ckpt", shards))


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (
            "both scale names",
            "tensor fp8.weight_scale_inv is stored under 2 names (fp8.weight_scale_inv, fp8.scale)",
        ),
        ("bad prefix", "base_model_prefix is '../model', expected a module name"),
    ],
)
def test_a_name_under_two_forms_or_a_path_as_prefix_is_refused(
    change: str, error: str, base: Base, tmp_path: Path
) -> None:
    doc, shards = copy.deepcopy(base.doc), copy.copy(base.shards)
    if change == "bad prefix":
        doc["base_model_prefix"] = "../model"
    else:
        shards[SHARDS[1]] = {
            **shards[SHARDS[1]],
            "fp8.scale": shards[SHARDS[1]]["fp8.weight_scale_inv"].clone(),
        }
    (tmp_path / "map.json").write_text(json.dumps(doc))
    _refused(tmp_path / "map.json", _write(tmp_path / "ckpt", shards), error)


def test_a_tensor_missing_from_the_shard_the_index_names_or_from_every_shard(
    base: Base, tmp_path: Path
) -> None:
    wrong = _write(tmp_path / "wrong", base.shards, index=False)
    _with_index(wrong, base.shards, {SHARDS[0]: SHARDS[1], SHARDS[1]: SHARDS[1]})
    _refused(
        base.doc, wrong, f"{wrong / SHARDS[1]}: has no tensor dense.weight, though the index says it does"
    )
    missing = _write(tmp_path / "missing", _replaced(base.shards, "experts.1.w", None))
    _refused(base.doc, missing, f"{missing}: checkpoint has no tensor experts.1.w")


# ---------------------------------------------------------------- malformed files


def _damaged(data: bytes) -> dict[str, Any]:
    return {
        "garbage": b"this is not a safetensors file",
        "empty": b"",
        "truncated": data[: len(data) // 2],
        "header-overruns": (10**6).to_bytes(8, "little") + data[8:],
    }


@pytest.mark.parametrize("kind", ["garbage", "empty", "truncated", "header-overruns"])
@pytest.mark.parametrize("index", [True, False], ids=["indexed", "globbed"])
def test_a_shard_that_is_not_a_safetensors_file_is_one_error(
    kind: str, index: bool, base: Base, tmp_path: Path
) -> None:
    folder = _write(tmp_path / "ckpt", base.shards, index=index)
    shard = folder / SHARDS[0]
    shard.write_bytes(_damaged(shard.read_bytes())[kind])
    _refused(base.doc, folder, f"{shard}: not a readable safetensors file")


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b'{"weights": {', "not a readable weight map (expected UTF-8 JSON)"),
        (b"\xff\xfe{}", "not a readable weight map (expected UTF-8 JSON)"),
        (b"[" * 100_000 + b"]" * 100_000, "not a readable weight map (expected UTF-8 JSON)"),
        (b'{"weights": {}, "weights": {}}', "duplicate key 'weights'"),
        (b"[]", "the document is [], expected an object"),
        (b"null", "the document is None, expected an object"),
    ],
    ids=["truncated", "not-utf8", "nested", "duplicate-key", "list", "null"],
)
def test_a_malformed_weight_map_file_is_one_error_naming_it(
    content: bytes, expected: str, base: Base, tmp_path: Path
) -> None:
    (tmp_path / "map.json").write_bytes(content)
    _refused(tmp_path / "map.json", base.folder, f"{tmp_path / 'map.json'}: ", expected)
    _refused(
        tmp_path / "absent.json", base.folder, f"{tmp_path / 'absent.json'}: the weight map does not exist"
    )


def _mutated(
    doc: dict[str, Any], at: list[Any], value: Any = None, *, delete: bool = False
) -> dict[str, Any]:
    """A deep copy of ``doc`` with the node at key path ``at`` set to ``value`` (or deleted)."""
    out = copy.deepcopy(doc)
    parent = out
    for key in at[:-1]:
        parent = parent[key]
    if delete:
        del parent[at[-1]]
    else:
        parent[at[-1]] = copy.deepcopy(value)
    return out


WEIGHT_MAP_CASES = sorted(p.stem for p in (CASES / "weight_maps").glob("*.json"))


@pytest.mark.parametrize("case", WEIGHT_MAP_CASES)
def test_tampered_weight_map(case: str, base: Base, tmp_path: Path) -> None:
    """Each file of tests/hostile/checkpoints/weight_maps/: one change to the valid map, refused naming
    the map file (or the checkpoint, for a map the checkpoint does not match: ``"names": "checkpoint"``)."""
    spec = json.loads((CASES / "weight_maps" / f"{case}.json").read_text())
    doc = _mutated(base.doc, spec["at"], spec.get("value"), delete=spec.get("delete", False))
    (tmp_path / "map.json").write_text(json.dumps(doc))
    named = base.folder if spec.get("names") == "checkpoint" else tmp_path / "map.json"
    _refused(tmp_path / "map.json", base.folder, f"{named}", *spec["error"])


# ---------------------------------------------------------------- property: any tampered map


def _paths(node: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The key path of every node under ``node`` (not ``node`` itself)."""
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    return [path for key, child in children for path in [(*at, key), *_paths(child, (*at, key))]]


JSON_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**30), 10**30), st.floats(), st.text(max_size=6),
    st.lists(st.integers(-3, 70), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)  # fmt: skip
DTYPE_STRINGS = st.one_of(
    st.sampled_from([*DTYPES, "Tensor", "os", "nn", "float8_e5m2", "complex64", "", "torch.float32"]),
    st.text(max_size=12),
)
SIZES = st.one_of(st.integers(-3, 70), st.sampled_from([0, 2**31, 2**63, 10**30, -(10**30)]))


@st.composite
def tampered(draw: st.DrawFn, doc: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(kind, ``doc`` with one change): a dict key dropped, a node swapped for another JSON type, a
    dtype string replaced, or an integer (size, dim, op or storage argument) replaced by another."""
    paths = _paths(doc)
    kind = draw(st.sampled_from(["drop", "retype", "dtype", "integer"]))
    if kind == "drop":
        at = draw(st.sampled_from([p for p in paths if isinstance(p[-1], str)]))
        return kind, _mutated(doc, list(at), delete=True)
    if kind == "dtype":
        at = draw(st.sampled_from([p for p in paths if p[-1] == "dtype"]))
        return kind, _mutated(doc, list(at), draw(DTYPE_STRINGS))
    if kind == "integer":
        at = draw(st.sampled_from([p for p in paths if type(_at(doc, p)) is int]))
        return kind, _mutated(doc, list(at), draw(SIZES))
    at = draw(st.sampled_from(paths))
    value = draw(JSON_VALUES.filter(lambda v: type(v) is not type(_at(doc, at))))
    return kind, _mutated(doc, list(at), value)


def _at(doc: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        doc = doc[key]
    return doc


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_tampered_weight_map_loads_the_same_weights_or_is_one_error(
    base: Base, data: st.DataObject
) -> None:
    """No change to a valid map ends in anything but a KadaptError or weights honouring the map. A
    dropped key, a swapped type or another dtype string leaves nothing valid but the same weights (an
    unread key); another integer may be a valid map of other weights (an op argument), so there the
    weights need only have the shapes and dtypes the changed map states."""
    kind, doc = data.draw(tampered(base.doc))
    try:
        weights = load_weights(doc, base.folder)
    except KadaptError:
        return
    assert set(weights) == set(doc["weights"])
    for name, tensor in weights.items():
        entry = doc["weights"][name]
        assert list(tensor.shape) == entry["shape"] and tensor.dtype == DTYPES[entry["dtype"]], name
        if kind != "integer":
            assert torch.equal(tensor, base.expected[name]), (kind, name)
