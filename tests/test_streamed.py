"""A streamed export (exporter/streamed.py): a model traced without its weights, each weight read from the checkpoint
once, as the engine is written, gives the engine an export in memory gives, node for node and weight for weight (fp32,
int8-channel and int4, tied and untied embeddings, heads sharing the lm_head); what it cannot stream is refused before any
work, in one line; and the native step reads an engine's external weights one at a time, refusing a weight that does
not lie in its own data file."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
import torch
from conftest import STORIES, _tiny_config
from onnx import numpy_helper

from medusa_trt.cli.export import main as export_main
from medusa_trt.exporter import lazy_weights, streamed
from medusa_trt.exporter import onnx_export as export
from medusa_trt.exporter.wrapper import load_medusa
from medusa_trt.runtime.native_graph import NativeCannotRun, read_tensor

pytestmark = pytest.mark.skipif(not STORIES.is_file(), reason=f"{STORIES} missing")

LAZY_ABOVE = 1000  # streamed.EAGER_ELEMENTS here: every matrix of the tiny model is a lazy weight (its norms are not)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, stories_base):
    """Tiny random Llamas in bf16 (as checkpoints are published), tied and untied, in several shards."""
    from transformers import AutoModelForCausalLM

    made = {}
    for tied in (False, True):
        torch.manual_seed(3)
        config = _tiny_config("llama")
        config.tie_word_embeddings = tied
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 1:
                    p.add_(torch.randn_like(p) * 0.1)  # norms other than ones
        folder = tmp_path_factory.mktemp("tied" if tied else "untied")
        model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="60KB")
        stories_base.tokenizer.save_pretrained(folder)
        made[tied] = folder
    return made


def _graph(path):
    proto = onnx.load(str(path))
    nodes = [(n.op_type, list(n.input), list(n.output)) for n in proto.graph.node]
    return nodes, {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}


class _Counted(streamed.Checkpoint):
    """A checkpoint that counts its reads, by tensor name."""

    reads: Counter

    def tensor(self, name: str, dtype=np.float32) -> np.ndarray:
        self.reads.update([name])
        return super().tensor(name, dtype)


def _export(folder, out, quantize, stream: bool, reads: Counter | None = None):
    checkpoint = None
    if stream:
        opened = streamed.Checkpoint.open(folder)
        checkpoint = _Counted(opened.folder, opened.files)
        object.__setattr__(checkpoint, "reads", reads if reads is not None else Counter())
    out.parent.mkdir(parents=True, exist_ok=True)
    model = load_medusa(str(folder), untrained_heads=2, weights=not stream)
    config = export.ExportConfig(out=out, tree="chain-2", max_batch=2, max_context=64, quantize=quantize, verify=not stream)
    return export.export_onnx(model, config, checkpoint)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("quantize", [None, "int8-channel", "int4"], ids=["fp32", "int8-channel", "int4"])
def test_a_streamed_export_is_the_export_in_memory(checkpoints, tmp_path, monkeypatch, tied, quantize):
    monkeypatch.setattr(streamed, "EAGER_ELEMENTS", LAZY_ABOVE)
    monkeypatch.setattr(export, "EXTERNAL_DATA_BYTES", 1024)  # the in-memory export's weights in a data file too
    reads = Counter()
    plain = _export(checkpoints[tied], tmp_path / "memory" / "m.onnx", quantize, stream=False)
    lazy = _export(checkpoints[tied], tmp_path / "streamed" / "m.onnx", quantize, stream=True, reads=reads)
    for graph in ("step", "heads"):
        want, got = _graph(getattr(plain.files, graph)), _graph(getattr(lazy.files, graph))
        assert got[0] == want[0], f"{graph} graph: other nodes"
        assert sorted(got[1]) == sorted(want[1]), f"{graph} graph: other weights"
        for name, values in want[1].items():
            assert got[1][name].dtype == values.dtype and np.array_equal(got[1][name], values), f"{graph} graph: {name}"
    checkpoint = streamed.Checkpoint.open(checkpoints[tied])
    big = [n for n in checkpoint.files if int(np.prod(streamed.checkpoint_shape(checkpoint, n))) > LAZY_ABOVE]
    assert big and all(reads[n] >= 1 for n in checkpoint.files)
    # each matrix read once per graph that holds it (the lm_head: the step graph and the heads'; tied, the embedding
    # also for its Gather), never once per pass over it
    assert max(reads.values()) <= 3 and sum(reads.values()) <= len(checkpoint.files) + 4, reads
    assert not list(tmp_path.glob("streamed/*.tmp*")), "staging left behind"


def test_lazy_weights_are_made_once_when_written_and_only_inside_their_export(tmp_path):
    made = []
    with lazy_weights.LazyWeights() as store:
        a = store.proto("a", (2, 3), np.float32, lambda: made.append("a") or np.arange(6, dtype=np.float32).reshape(2, 3))
        t = lazy_weights.derived("a_t", [a], lambda w: w.T, (3, 2))
        assert lazy_weights.is_lazy(t) and made == []  # a recipe of a recipe: nothing read yet
        eager = lazy_weights.derived("b", [numpy_helper.from_array(np.ones((2, 2), np.float32), "one")], lambda w: w * 2, (2, 2))
        assert not lazy_weights.is_lazy(eager) and numpy_helper.to_array(eager).tolist() == [[2, 2], [2, 2]]
        proto = onnx.helper.make_model(
            onnx.helper.make_graph(
                [onnx.helper.make_node("MatMul", ["x", "a_t"], ["y"])],
                "g",
                [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3])],
                [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 2])],
                [t],
            )
        )
        lazy_weights.save(proto, tmp_path / "g.onnx", inline_bytes=0)
        assert made == ["a"]
        bad = store.proto("bad", (2, 2), np.float32, lambda: np.zeros((3, 3), np.float32))
        with pytest.raises(ValueError, match="made float32\\[3, 3\\], not float32\\[2, 2\\]"):
            lazy_weights.array(bad)
    loaded = onnx.load(str(tmp_path / "g.onnx"))
    assert numpy_helper.to_array(loaded.graph.initializer[0]).tolist() == [[0, 3], [1, 4], [2, 5]]
    with pytest.raises(RuntimeError, match="read outside the export"):
        lazy_weights.array(bad)


def _run(capsys, *args) -> tuple[int, str]:
    code = export_main([str(a) for a in args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, said",
    [
        (["--quantize", "int8"], "--quantize int8 reads every weight at once"),
        (["--dtype", "fp16"], "--dtype fp16: a streamed export writes fp32 engines"),
    ],
)
def test_what_a_streamed_export_cannot_do_is_refused_before_any_work(checkpoints, tmp_path, capsys, extra, said):
    out = tmp_path / "engine"
    code, err = _run(capsys, "--model", checkpoints[False], "--untrained-heads", "2", "--out", out, "--stream-weights", *extra)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and said in lines[0], err
    assert not out.exists() and not list(tmp_path.iterdir())


def test_stream_weights_needs_safetensors(tmp_path, capsys):
    code, err = _run(capsys, "--model", STORIES, "--untrained-heads", "2", "--out", tmp_path / "e", "--stream-weights")
    assert code == 2 and "has none of: drop --stream-weights" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())


def test_a_corrupt_checkpoint_is_one_line_streamed_or_not(checkpoints, tmp_path, capsys):
    import shutil

    folder = tmp_path / "corrupt"
    shutil.copytree(checkpoints[False], folder)
    (folder / "model.safetensors.index.json").unlink()
    first = sorted(folder.glob("*.safetensors"))[0]
    first.write_bytes(b"\x10\0\0\0\0\0\0\0{not json}      ")
    for flag in ("--stream-weights", "--no-stream-weights"):
        code, err = _run(capsys, "--model", folder, "--untrained-heads", "2", "--out", tmp_path / "e", flag)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, (flag, err)
        assert flag != "--stream-weights" or f"{first} is not a valid safetensors file" in lines[0], err
        assert not (tmp_path / "e").exists()


def test_a_checkpoint_missing_a_weight_by_name_is_refused_naming_it(checkpoints, tmp_path, capsys):
    import json
    import shutil

    folder = tmp_path / "renamed"
    shutil.copytree(checkpoints[False], folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k.replace("o_proj", "dense"): v for k, v in index["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    code, err = _run(capsys, "--model", folder, "--untrained-heads", "2", "--out", tmp_path / "e", "--stream-weights")
    assert code == 2 and "has no tensor model.layers.0.self_attn.o_proj.weight" in err and "Traceback" not in err
    assert not (tmp_path / "e").exists()


def test_the_export_streams_where_the_fp32_weights_exceed_half_the_memory(checkpoints, monkeypatch):
    folder = checkpoints[False]
    need = streamed.Checkpoint.open(folder).fp32_bytes()
    monkeypatch.setattr(streamed, "available_memory", lambda: need)  # fp32 weights = all the memory there is
    assert streamed.should_stream(str(folder), None) is not None
    monkeypatch.setattr(streamed, "available_memory", lambda: 4 * need)
    assert streamed.should_stream(str(folder), None) is None
    assert streamed.should_stream(str(folder), True) is not None and streamed.should_stream(str(folder), False) is None
    assert streamed.should_stream("smollm2-135m", None) is None


def test_native_reads_each_external_weight_from_its_own_data_file_only(tmp_path):
    step = tmp_path / "model.onnx"
    (tmp_path / "model.onnx.data").write_bytes(np.arange(8, dtype=np.float32).tobytes())
    (tmp_path.parent / "secret").write_bytes(b"\0" * 64)

    def external(location: str, offset: int, length: int):
        t = onnx.TensorProto(name="w", dims=[2, 2], data_type=onnx.TensorProto.FLOAT)
        t.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
            t.external_data.add(key=key, value=value)
        return t

    got = read_tensor(external("model.onnx.data", 16, 16), step, numpy_helper.to_array)
    assert got.tolist() == [[4, 5], [6, 7]]
    for location, offset, length, said in [
        ("../secret", 0, 16, "not a data file beside the graph"),
        ("model.onnx.data", 24, 16, "does not fit"),
        ("model.onnx.data", 0, 12, "does not fit"),
    ]:
        with pytest.raises(NativeCannotRun, match=said):
            read_tensor(external(location, offset, length), step, numpy_helper.to_array)


def test_a_streamed_engine_folder_generates_what_the_in_memory_one_does(checkpoints, tmp_path, capsys, monkeypatch):
    """Through medusa-export, into folders whose backend the export chooses: the same text drafted, and the same as
    each engine's plain decoding."""
    from medusa_trt.runtime import MedusaRuntime

    monkeypatch.setattr(streamed, "EAGER_ELEMENTS", LAZY_ABOVE)
    engines = {}
    for flag in ("--no-stream-weights", "--stream-weights"):
        out = tmp_path / flag.strip("-")
        argv = ["--model", checkpoints[False], "--untrained-heads", "2", "--tree", "chain-2", "--max-batch", "1"]
        code, err = _run(capsys, *argv, "--max-context", "96", "--quantize", "int8-channel", "--out", out, flag)
        assert code == 0, err
        engines[flag] = out
    prompt = [1, 5, 9, 14, 3]
    outputs = {}
    for flag, folder in engines.items():
        runtime = MedusaRuntime(folder, threads=1)
        drafted = runtime.generate([prompt], max_new_tokens=24)[0].token_ids
        plain = runtime.plain().generate([prompt], max_new_tokens=24)[0].token_ids
        assert drafted == plain, flag
        outputs[flag] = drafted
    assert outputs["--stream-weights"] == outputs["--no-stream-weights"]
