"""The reference MoE trainer: `python -m moe_perf.trainer <arm_dir>/config.yaml` (see train.py).

Torch only; no Hydra. train.py builds the run and loops over steps (runtime.py: device, process
group, metric reductions; profiling.py: torch.profiler). Model code is single-device: model.py
(the transformer), attention.py, layers.py (norm, dense FFN, init streams), moe.py (the MoE
block) with routing.py, dispatch.py, experts.py and balance.py. All distribution is applied
by parallelize.py (with ep.py, cp.py and pp.py), which injects collectives and process groups
into the model code.

Shape legend of the hot code: a tensor's name ends in its dimensions, `x_TD` is [T, D].
  B  sequences of a micro-batch            S  positions of a sequence held by this rank
  A  all positions of a sequence (cp*S)    C  one zig-zag chunk of a sequence (S/2 under CP)
  T  tokens on this rank (B*S)             D  hidden width
  H  query heads     G  key/value heads    d  q/k head dim     v  value head dim
  X  K and V packed together (d + v)       R  rotary dims (<= d)          V  vocabulary
  E  routed experts (global)               L  experts held here (E, or E/ep under EP)
  K  top-k           F  FFN width          P  EP ranks (ep)
  Q  (token, k) slots of this rank's tokens (T*K), in the order they are sent to the experts
  N  (token, k) slots this rank's experts process (T*K on one device; those received under EP)
"""
