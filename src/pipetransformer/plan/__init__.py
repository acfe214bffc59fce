"""The offline predictor: a whole run of a config or a named model on a cluster (``pipetransformer plan``).

``cluster`` (devices and links, presets), ``model_spec`` (models described analytically, no weights), ``simulate``
(one step's schedule, all-reduce included), ``levers`` (the fastest fit of stages, recomputation and bf16),
``runplan`` (a freeze timeline's phases) and ``command`` (the ``plan`` command). All pure except ``command``'s
profiling. The live AutoPipe (``pipetransformer.pipe``) asks it one question, through
:func:`~pipetransformer.plan.levers.fastest_local_fit`, when ``pipe.recompute`` is on.
"""
