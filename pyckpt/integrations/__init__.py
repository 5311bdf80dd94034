"""Integrations of pyckpt with training frameworks: one optional module per framework (pyckpt.integrations.torchtitan, .lightning, .accelerate), each needing its extra."""
