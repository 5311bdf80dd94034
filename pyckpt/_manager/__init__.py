"""The parts of :class:`pyckpt.CheckpointManager` (:mod:`pyckpt.manager`): ``info`` (its
records), ``groups`` (its gloo groups), ``base`` (shared state, failures and notices),
``retention``, ``persist`` (durable tier in the background), ``save`` (the save thread's work)
and ``restore``. The class and its public API live in :mod:`pyckpt.manager`."""
