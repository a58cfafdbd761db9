"""Render plans and simulations as text tables, JSON documents and Chrome traces.

Kept apart from the arithmetic so that the numbers have one source: the JSON is what tests and
scripts read, the tables are the same fields for people. Warnings are printed as ``WARNING:`` lines.
One module per thing rendered: ``plan`` (``kadapt plan``), ``simulation`` (``kadapt simulate``, with
``--images``) and ``trace`` (``--trace``: a Chrome trace of one step), over ``blocks`` (the text
table and the memory figures both print). Importing them does not import torch.
"""
