"""What-if benchmark: the real vLLM schedulers on a virtual clock, charged
by an accelerator cost model (``neuron-scheduler bench``)."""
