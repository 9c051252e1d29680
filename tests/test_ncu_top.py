"""benchmarks/ncu_top.py on a hand-made ncu source CSV and nvdisasm -g listing: samples land
on the source line of their SASS offset (addresses relative to the kernel's first
instruction), and the per-line sums add every instruction of a line."""
from benchmark_scripts import load

SASS = """\t.section\t.text.mokgen_bwd,"ax",@progbits
mokgen_bwd:
\t//## File "/tmp/build.x/kernel.cu", line 157
        /*0000*/                   LDC R1, c[0x0][0x28] ;
\t//## File "/work/mokgen/runtime/include/mokgen/wgmma.cuh", line 63
        /*0010*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0020*/                   NOP ;
\t//## File "/work/mokgen/runtime/include/mokgen/ptx.cuh", line 114
        /*0030*/                   @P0 BRA 0x30 ;
"""


def test_samples_are_summed_per_source_line(tmp_path, capsys):
    ncu_top = load("ncu_top")
    sass = tmp_path / "k.sass"
    sass.write_text(SASS)
    assert ncu_top.line_map(str(sass)) == {0x0: "kernel.cu:157", 0x10: "wgmma.cuh:63",
                                           0x20: "wgmma.cuh:63", 0x30: "ptx.cuh:114"}
    base = 0x7F0000001000  # ncu's addresses are absolute
    head = ['"Address"', '"Source"', '"Warp Stall Sampling (All Samples)"', '"stall_barrier"',
            '"stall_long_sb"', '"stall_wait"']
    rows = [(0x00, "LDC R1", 1, 0, 0, 1), (0x10, "WARPGROUP.DEPBAR.LE", 60, 55, 0, 5),
            (0x20, "NOP", 10, 0, 0, 10), (0x30, "@P0 BRA", 29, 0, 29, 0)]
    csv = tmp_path / "k.csv"
    csv.write_text('"Kernel Name","mokgen_bwd",\n' + ",".join(head) + "\n" + "".join(
        f'"0x{base + a:x}","{src}","{n}","{b}","{ls}","{w}"\n' for a, src, n, b, ls, w in rows))
    ncu_top.main([str(csv), "--sass", str(sass), "--top", "10"])
    out = capsys.readouterr().out
    per_line = out[out.index("per source line:"):].splitlines()[1:]
    got = {ln.split()[0]: float(ln.split()[1].rstrip("%")) for ln in per_line}
    assert got == {"wgmma.cuh:63": 70.0, "ptx.cuh:114": 29.0, "kernel.cu:157": 1.0}
    # the per-instruction rows name their lines too, the most sampled first
    first = out.splitlines()[1]
    assert "wgmma.cuh:63" in first and "60.00%" in first
