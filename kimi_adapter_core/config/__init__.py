"""Model configs from a spec's source, with config bridges applied and the gate checked.

Modules: ``paths`` (dotted/indexed paths), ``source`` (where the raw config comes from),
``bridges`` (the bridge ops), ``build`` (config class, object, gate), ``load`` (the pipeline).
"""
