"""The benchmark suite: the blog's table on this GPU, every peer side by side, the
size-matched copy ceiling, and the product's performance targets, all from one run.

Run from a checkout on a GPU machine::

    PYTHONPATH=. python3 scripts/bench.py --quick        # a few cases of every section, ~6 min (H100)
    PYTHONPATH=. python3 scripts/bench.py                # every case, well over 10 min
    PYTHONPATH=. python3 scripts/bench.py --cases "blog,tail/T=1/*"
    PYTHONPATH=. python3 scripts/bench.py --write-docs   # also regenerate docs/benchmarks.md
    python3 scripts/bench.py --from-json bench.json --write-docs   # re-render a saved run, no GPU
    python3 scripts/bench.py --list                      # the cases, without running anything

Method (docs/design.md, "Measuring"):

* Effective bandwidth = bytes moved / time, where bytes moved is a property of the case, not of
  the implementation: input bytes read + output bytes written + table bytes read (the rows the
  case's positions use, FP32 cos and sin) + position indices. A peer that reads a wider table
  (Hugging Face's duplicated ``[S, D]`` cos/sin) is not credited for it.
* The ceiling of each case is a device-to-device copy (``cudaMemcpyAsync``) moving the same
  number of bytes (half read, half written), measured the same way in the same run; one 4 GiB
  copy is reported for reference.
* Regimes: ``hot`` (CUDA events around back-to-back calls on the same buffers), ``cold``
  (rotating among buffer sets whose total exceeds 4x the L2; identical to hot when one set
  already does), and for small cases ``graph`` / ``graph_cold`` (GPU time per call under CUDA
  graph replay of K captured calls) and ``host`` (wall time of bursts of 100 calls queued
  behind a GPU kernel that outlasts them, so that the GPU never holds the host back).
  Each figure is the median of repeated samples after a warm-up; call counts adapt so that a
  sample lasts about a millisecond or more.
* Every implementation's output is checked before it is timed (a subsample against the float64
  or bit-exact reference); a wrong answer is reported as WRONG and not timed.

Modules (each imports only those above it):

* ``cases``: shared constants and targets, ``Skip``/``Wrong``, :class:`Case`, the case builders,
  the ``--cases`` filter and the cold-set count.
* ``arguments``: command-line parsing, the default JSON path, the regenerating command.
* ``timing``: :class:`Clock` (CUDA events, host timers), rotation, CUDA-graph capture.
* ``buffers``: the device buffers of a case and the checks against the reference.
* ``impls``: rope_rtc and every peer (CuPy, PyTorch/Hugging Face, torch.compile, Liger).
* ``figures``: figures derived from a result (µs, GB/s, % of copy, fastest peer).
* ``report``: tables, targets, stdout summary, JSON, plot, docs/benchmarks.md.
* ``runner``: one case, the host-cost and cold-start sections, the whole run.
* ``cli``: the entry point, :func:`rope_rtc.benchmark.cli.main`.

``rope_rtc.bench`` is the entry point (``rope-rtc bench``, ``scripts/bench.py``).
"""
