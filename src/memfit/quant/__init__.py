"""Weights stored smaller than they run: GGUF block formats and fp8, kept in their stored bytes everywhere.

A stored weight is an ``int8`` tensor of its file's bytes (memfit.quant.formats says how to read them),
so every part of memfit that moves, maps or sizes tensors sees its true size and never converts it:
the executor keeps it in its stored form in every tier, the planner counts its stored bytes, and
``module.dtype`` (which reads floating parameters) never sees it. It is dequantized in the forward of
the module that uses it (memfit.quant.layers), one layer at a time, into a temporary tensor.

memfit.quant.gguf reads GGUF files (city96's and stable-diffusion.cpp's: tensors in their original key
names) as memory-mapped views; memfit.quant.rows carries a layout's key conversion over tensors whose
stored shape is not their logical one.
"""
