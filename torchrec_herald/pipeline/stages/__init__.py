"""The stages a batch runs through on entering herald's window, one module each, in order: ``keys``
(validate ids, global row keys), ``allocate`` (which rank trains which sample), ``reads`` (every
rank's rows), and, for each step, ``plan`` (the step's transfers from the window's reads). Each takes
the batch's :class:`~torchrec_herald.pipeline.context.HeraldBatchContext` and the pipeline's
:class:`~torchrec_herald.pipeline.context.SchedulingEnv`; a scheduling strategy
(``pipeline/strategies.py``) picks which allocate and reads bodies run."""
