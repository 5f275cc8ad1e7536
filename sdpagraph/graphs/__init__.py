"""Score_mod IR, cuDNN graph lowering and the support answer."""
