"""benchmarks/torchtitan_train.py without a GPU: its data windows, its text folder, and its
report's band arithmetic over a results file (the training itself runs on the GPU machine)."""
import pytest
import torch

from benchmark_scripts import load

bench = load("torchtitan_train")
rf = load("result_file")


def test_windows_are_consecutive_text_with_labels_one_token_ahead():
    tokens = torch.arange(100)
    data = bench.batches(tokens, batch=3, seq=8, seed=5)
    seen = []
    for _ in range(6):  # 6 * 3 * 8 = 144 tokens: wraps around the 100
        x, y = next(data)
        assert x.shape == y.shape == (3, 8)
        assert torch.equal(y[:, :-1], x[:, 1:])
        assert torch.equal((x[:, 1:] - x[:, :-1]) % 100, torch.ones(3, 7, dtype=torch.int64))
        seen.append(x[:, 0])
    starts = torch.cat(seen)
    assert torch.equal((starts[1:] - starts[:-1]) % 100, torch.full((17,), 8))
    other = next(bench.batches(tokens, batch=3, seq=8, seed=6))[0]
    assert not torch.equal(other, next(bench.batches(tokens, batch=3, seq=8, seed=5))[0])


def test_the_text_folder_reads_plain_text_and_json_lines(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "c": 3},
                                                unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("a b a")
    (tmp_path / "b.json").write_text('{"text": "c c"}\n{"text": "b"}\n')
    (tmp_path / "notes.md").write_text("a a a a")  # neither: not read
    ids, vocab, names = bench.load_tokens(str(tmp_path))
    assert ids.tolist() == [1, 2, 1, 3, 3, 2] and vocab == 4 and names == ["a.txt", "b.json"]
    (tmp_path / "SOURCE").write_text("https://example.org/text\n")  # named, not read as text
    ids, _, names = bench.load_tokens(str(tmp_path))
    assert len(ids) == 6 and names == ["a.txt", "b.json", "from https://example.org/text"]


def _row(impl, seed, loss):
    return {"model": "debug", "impl": impl, "seed": seed, "layers": 8, "batch": 4, "seq": 64,
            "compile": True, "ac": "selective", "steps": len(loss), "steps_done": len(loss),
            "loss": loss, "tokens_per_s": 1000.0 + seed, "peak_mb": 10.0 * (seed + 1)}


def test_band_counts_the_steps_inside_the_seeds_range(tmp_path):
    rows = [_row("torchtitan", s, [lvl] * 10) for s, lvl in ((0, 1.0), (1, 2.0), (2, 3.0))]
    rows += [_row("mokgen", 0, [2.5] * 6 + [3.5] * 4),  # inside for 6 steps, then 0.5 above
             _row("mokgen-mxfp8", 0, [0.5] * 10)]
    band = bench.band_check(rows, window=1)
    assert band["mokgen seed 0"] == pytest.approx(
        {"inside_fraction": 0.6, "worst_excursion": 0.5, "steps": 10})
    assert band["mokgen-mxfp8 seed 0"]["inside_fraction"] == 0.0
    # each torchtitan seed against the other two: 1.0 and 3.0 lie 1.0 outside, 2.0 inside
    own = band["torchtitan (each seed against the others)"]  # [least, greatest] over seeds
    assert own.keys() == {"inside_fraction", "worst_excursion", "steps"} and own["steps"] == 10
    # (pytest.approx takes no lists inside a dict since pytest 9.2: each list apart)
    assert own["inside_fraction"] == pytest.approx([0.0, 1.0])
    assert own["worst_excursion"] == pytest.approx([0.0, 1.0])
    assert bench.band_check(rows[:1] + rows[3:], window=1) == {}  # one seed is no band
    meta = dict(gpu="NVIDIA H200", torch="2.11", cuda="13.0", commit="c1", time="t")
    for r in rows:  # as the runs write them, one per call
        rf.write("torchtitan_debug", [r], bench.KEY, out=str(tmp_path), meta=meta)
    assert bench.main(["report", "--model", "debug", "--results", str(tmp_path),
                       "--smooth", "1"]) == 0


def test_smoothing_is_a_trailing_mean():
    assert bench.smooth([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]


def test_idle_gaps_merge_streams_and_rank_the_gaps():
    # two streams overlapping (0-10, 5-12), a 3 us gap, then 15-20, a 10 us gap, 30-31
    busy, idle, gaps = bench.idle_gaps([(15, 20, "c"), (0, 10, "a"), (5, 12, "b"),
                                        (30, 31, "d")])
    assert busy == 18 and idle == 13
    assert gaps == [(10, "c", "d"), (3, "b", "c")]


def test_gpu_time_by_part_names_what_is_the_same_whatever_the_moe():
    """--profile's ms a step: AdamW and FSDP2's copies (the same for both MoEs), mokgen's
    kernels, and the rest (torchtitan's MoE among it), over the profiled steps."""
    kernels = [(0, 4000, "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<"),
               (4000, 5000, "Memcpy DtoD (Device -> Device)"),
               (5000, 6000, "void at::native::vectorized_elementwise_kernel<8, "
                            "at::native::bfloat16_copy_kernel_cuda(at::TensorIteratorBase&)"),
               (6000, 7000, "void at::native::detail::chunk_cat_cuda_kernel<float, "
                            "c10::BFloat16>"),
               (7000, 9000, "mokgen_fwd"), (9000, 13000, "mokgen_bwd"),
               (13000, 14000, "void at::native::vectorized_elementwise_kernel<4, "
                              "at::native::BUnaryFunctor<float, float, float, "
                              "at::native::binary_internal::MulFunctor<float> >"),
               (14000, 16000, "triton_tem_fused_flex_attention_0")]
    assert bench.gpu_time_by_part(kernels, steps=2) == {
        "optimizer": 2.0, "fsdp_copies": 2.0, "mokgen": 3.0, "rest": 1.0}


def test_peak_composition_replays_the_step_and_names_who_asked():
    """--memory-step: the peak is found over allocations and completed frees (a free of a
    block older than the recording lowers the count too), and what is live there is summed
    by the innermost frame outside torch."""
    def alloc(addr, size, where):
        frames = [{"filename": "/site/torch/nn/modules/linear.py", "line": 1, "name": "f"},
                  {"filename": f"/repo/{where}", "line": 7, "name": "g"}]
        return {"action": "alloc", "addr": addr, "size": size, "frames": frames}

    free = lambda addr, size: {"action": "free_completed", "addr": addr, "size": size}  # noqa
    mib = 2**20
    trace = [free(900, 2 * mib),                     # last step's gradient, set to None
             alloc(1, 3 * mib, "mokgen/runtime/moe.py"), alloc(2, 1 * mib, "model.py"),
             {"action": "free_requested", "addr": 2, "size": 1 * mib},  # not yet free
             alloc(3, 1 * mib, "model.py"),          # the peak: 10 - 2 + 3 + 1 + 1
             free(2, 1 * mib), free(3, 1 * mib), alloc(4, 2 * mib, "model.py")]
    got = bench.peak_composition({"device_traces": [trace]}, base_bytes=10 * mib)
    assert got == {"base_mb": 10.0, "peak_mb": 13.0,
                   "step_mb_by_site": [["moe.py:7 g", 3.0], ["model.py:7 g", 2.0]]}
    assert "13 MiB" in bench.format_peak(got)


def test_cuda_graph_runs_are_rows_of_their_own():
    """--cuda-graphs (torchtitan's trainer default) labels its rows apart, so a results file
    keeps eager and captured runs side by side, each judged against its eager bf16 base."""
    assert bench.label("mokgen", "bf16", True) == "mokgen+graphs"
    assert bench.label("torchtitan", "bf16") == "torchtitan"
    assert bench.label("mokgen", "fp8") == "mokgen-fp8"
    assert bench.label("mokgen", "fp8", True) == "mokgen-fp8+graphs"
    assert bench.base_impl("mokgen-fp8+graphs") == "mokgen"


def test_variants_are_judged_against_their_base_run_of_the_same_seed():
    """fp8 against bf16 mokgen and a CUDA-graph run against its eager twin, seed for seed:
    the final loss relative to the base's and the largest gap of the smoothed curves (issue
    63's proof: final loss within 0.5% relative, curves overlapping)."""
    assert [bench.base_impl(i) for i in ("mokgen-fp8", "mokgen-mxfp8", "mokgen+graphs",
                                         "torchtitan+graphs", "mokgen")] == \
        ["mokgen", "mokgen", "mokgen", "torchtitan", "mokgen"]
    rows = [_row("mokgen", 0, [2.0] * 8 + [1.0] * 4),
            _row("mokgen-fp8", 0, [2.0] * 8 + [1.004] * 4),   # 0.4% above at the end
            _row("mokgen-fp8", 1, [9.0] * 12),                # no bf16 run of seed 1: none
            _row("torchtitan", 0, [3.0] * 12), _row("torchtitan+graphs", 0, [3.0] * 12)]
    got = bench.variant_check(rows, window=4)
    assert set(got) == {"mokgen-fp8 seed 0 against mokgen",
                        "torchtitan+graphs seed 0 against torchtitan"}
    fp8 = got["mokgen-fp8 seed 0 against mokgen"]
    assert fp8["final_rel"] == pytest.approx(0.004) and fp8["steps"] == 12
    assert fp8["max_gap"] == pytest.approx(0.004)
    same = got["torchtitan+graphs seed 0 against torchtitan"]
    assert same["final_rel"] == 0.0 and same["max_gap"] == 0.0
