"""A worker that says whether the job secret reached it: in os.environ, in its process's
environment block (/proc/self/environ: what a new interpreter was given, or what a forked
process inherited), or as the secret file's name. The secret is its last argument. And
whether its Flight Recorder dumps would go beside its error file (issue 38), by both names."""

import os
import sys

secret = sys.argv[-1].encode()
with open("/proc/self/environ", "rb") as f:
    block = f.read()
print(f"probe rank {os.environ.get('RANK')}: environ={'FT_JOB_SECRET' in os.environ} "
      f"file_env={'FT_JOB_SECRET_FILE' in os.environ} block={secret in block} "
      f"key={'FT_INPROCESS_KEY' in os.environ}", flush=True)
fr = os.environ.get("TORCH_FR_DUMP_TEMP_FILE", "")
error_file = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
print(f"probe rank {os.environ.get('RANK')}: fr_beside_error_file="
      f"{bool(fr) and os.path.dirname(fr) == os.path.dirname(error_file)} "
      f"fr_old_name={os.environ.get('TORCH_NCCL_DEBUG_INFO_TEMP_FILE') == fr}", flush=True)
