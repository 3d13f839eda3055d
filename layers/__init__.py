"""What models and transforms share, with no model in it: the causal attention core that context
parallelism swaps (attention.py), routed experts held in NF4 as QLoRA stores them (nf4_experts.py),
per-parameter seeds that make initialisation independent of order and layout (init.py), and the
router's name. Models and `parallelisms/`, `float8/` import it; it imports only torch."""

# The attribute name of an MoE layer's router (models/common/moe.py): LoRA and float8 leave layers of
# this name as they are (an adapter or float8 rounding there would move the routing).
ROUTER = "router"
