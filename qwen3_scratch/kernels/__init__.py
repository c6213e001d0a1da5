"""Fast paths for the model, swapped in at load time over the unchanged model.

matvec.py (one-row products compiled by inductor into streaming loops), cpu_decode.py (the ops between
them as a few kernels a layer), one_row_attention.py (a decode step's attention as one kernel over the cache
in place), fewrow.py (products of a few rows sharing one read of a bf16 matrix packed for oneDNN:
speculative decoding's verification), fuse.py (fused, oneDNN-prepacked matrices for batches), quantize.py
(int8 weights), int4.py (int4 weights), widen.py (products of many half-precision rows in fp32, on a CPU
without bf16 instructions), sgemm.py (fp32 products of several rows through oneDNN on a CPU not made by Intel,
where MKL's are slow) and layout.py, which picks among them; aot.py keeps the compiled
kernels on disk as AOTInductor packages, so a later start loads them without the compiler (aot_build.py
builds them, once, in the background). Each module says what it buys, measured, and
which test proves it equals the exact path (the model's own layers, model/).

May import: model, the package root. Imported by: checkpoint (load_model applies the layout), parallel (so does
each rank), generation (speculation packs its target: fewrow.py), engine (aot.py: the in-place paged
attention's stored package).
"""
