"""One loader, one way down: a checkpoint becomes our model one module (one decoder layer) at a time.

    resolve (models.resolve)  ->  a reader per format (formats.py: HF float / GGUF-converted, GPTQ,
    compressed-tensors)  ->  the model built on the meta device (models.loader.build_empty)  ->  for each
    top-level module: quantized linears land as runtime modules (landing.py), the rest is filled from the
    checkpoint (models.loader.fill_module), and, for the engine, packed (landing.pack_module)  ->  next.

So a model is never in memory twice: the plain bf16 copy of a layer is packed and freed before the next
layer is read. The engine, `eval` (through the engine) and `calibrate` load here; `quantize` streams the
same reader and fill (quant/pipeline.py). This package sits above models/, layers/ and quant's weight
formats, and below engine/, calibrate/ and quant's pipeline.
"""
