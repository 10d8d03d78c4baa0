#!/usr/bin/env bash
# The checks that need a GPU, as one command for a lent GPU machine (run from the repository root;
# results under $OUT, or ./gpu-out).  That machine has its own python3 with torch, numpy, pyarrow and
# xxhash but no torchdata or zstandard: their wheels travel in .whl/, fetched here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform any -d .whl torchdata==0.11.0 zstandard
# and the record-cost packs in .costpack/costpack.tar.xz (scripts/make_cost_pack.py); both folders
# are listed in .git/info/exclude and named in the device call's carry.
#   1. scripts/check_cuda_materialize.py: SimpleCustomBatch.cuda() bit-identical to the CPU tensors,
#      on synthetic batches and on the real packs' records; the loader feeding the GPU.
#   2. scripts/time_record_cost.py: a BAGEL-7B-shaped forward+backward per record, and the cost fit.
#   3. scripts/check_latents_device.py: the VAE latents on the GPU (issue 51): the stage's moments
#      against the recipe's bf16 autocast encode, the difference from the CPU's, the loader's draw
#      against the recipe's encode for the same noise, and the encode time the latents save.  It
#      needs NeMo's autoencoder.py in .nemo/ (cp from site-packages/nemo_automodel/components/models/
#      bagel/) and einops + safetensors wheels in .whl/ (pip download ... einops safetensors).
set -uo pipefail
out="${OUT:-gpu-out}"
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_checks: wheels did not install" >&2; exit 1; }
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$out/gpu.txt"
packs=$(mktemp -d)
tar xJf .costpack/costpack.tar.xz -C "$packs"
rc=0
timeout 150 python3 scripts/check_cuda_materialize.py --batches 12 2>&1 | tee "$out/cuda_synthetic.log" || rc=1
for p in "$packs"/*/; do
  name=$(basename "$p")
  timeout 120 python3 scripts/check_cuda_materialize.py --pack "$p" --batches 24 2>&1 | tee "$out/cuda_$name.log" || rc=1
done
budget="${COST_SECONDS:-270}"  # the script stops starting records then, and fits what it timed
timeout "$((budget + 90))" python3 scripts/time_record_cost.py --pack .costpack/costpack.tar.xz --device cuda \
  --time-budget "$budget" --max-records "${COST_RECORDS:-160}" --reps "${COST_REPS:-2}" --csv "$out/record_cost.csv" \
  --fit "$out/record_cost_fit.json" 2>&1 | tee "$out/record_cost.log" || rc=1
if [ -f .nemo/autoencoder.py ]; then
  for p in "$packs"/*/; do
    name=$(basename "$p")
    timeout 240 python3 scripts/check_latents_device.py --pack "$p" --device cuda --records "${LATENT_RECORDS:-8}" \
      --module-file .nemo/autoencoder.py 2>&1 | tee "$out/latents_$name.log" || rc=1
  done
else
  echo "gpu_checks: no .nemo/autoencoder.py: the latents check was not run" | tee "$out/latents.log"
fi
exit $rc
