"""The room of integrations with the frameworks people train with (docs/integrations.md).

- `lightning`: callbacks for PyTorch Lightning (``lightning`` or ``pytorch_lightning``),
  ours and nvidia-resiliency-ext's ``ptl_resiliency`` names;
- `transformers`: `FtTrainerCallback` for the Hugging Face Trainer (transformers 4.45 or later);
- `state_file`: the learned timeouts' file in a Lightning ``exp_dir``, read and written under
  `ft_client.safefiles`' rule for folders others may write.

Each module imports its framework when it is imported, never before: ``import ft_client``
imports none of them. May import the client (``ft_client.client``), the hall and every room
below the client; nothing imports this room but the user's script.
"""
