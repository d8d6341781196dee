"""The model side: shapes (spec.py), finding, reading and building models (loader.py), the
building blocks model plugins assemble (decoder.py: norms, rotary embeddings, attention, the
gated MLP, the decoder; moe.py: the mixture of experts; mla.py: latent attention), the
runner (runner.py), CUDA graphs (cuda_graphs.py), the fused kernels the model uses
(fused_ops.py) and the Triton build counter (kernel_builds.py). Architectures themselves are
model plugins (plugins/model/)."""

from tessellm.core.compat import package_getattr

__getattr__ = package_getattr(__name__)  # names of the module this package replaced (deprecated)
