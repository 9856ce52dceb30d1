#!/usr/bin/env bash
# Pack what a bare CUDA machine without internet needs beyond its PyTorch image (CUDA, torch,
# transformers, safetensors, tokenizers, pytest are assumed there), as two archives that each
# fit a 64 MiB transfer with the repository:
#   .gpu_pack/engine.tar.xz   flashinfer-python (pinned, as in the [gpu] extra) and what it imports
#   .gpu_pack/trainer.tar.xz  megatron-core, Ray (without its Java jars), FastAPI/uvicorn/pydantic
# Run it where PyPI is reachable; docs/gpu.md says how the archives travel and are used.
#   bash scripts/gpu/pack.sh           PY=3.12 (the GPU machine's Python), PLATFORM=x86_64
#   bash scripts/gpu/pack.sh --list    print the pinned packages and exit
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-3.12}
ARCH=${PLATFORM:-x86_64}
ENGINE=(
  flashinfer-python==0.6.18 apache-tvm-ffi==0.1.15.post2 nvidia-cudnn-frontend==1.32.0
  nccl4py==0.6.0 cuda-tile==1.7.0 cuda-python==13.4.4
)
TRAINER=(
  megatron-core==0.16.1 ray==2.60.0 jsonschema==4.25.1 jsonschema-specifications==2025.9.1
  referencing==0.37.0 rpds-py==0.30.0 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.3
  pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 uvicorn==0.54.0
)
LIMIT_MIB=60  # of the 64 MiB a device call carries, the rest is for the repository
if [ "${1:-}" = "--list" ]; then
  printf 'engine: %s\ntrainer: %s\n' "${ENGINE[*]}" "${TRAINER[*]}"
  exit 0
fi
mkdir -p .gpu_pack
pack() {  # pack NAME PACKAGES...: install for the GPU machine's Python into a folder, archive it
  local name=$1; shift
  local dir; dir=$(mktemp -d)
  python3 -m pip install -q --no-deps --no-compile --only-binary=:all: --target "$dir" \
    --python-version "$PY" --implementation cp --platform "manylinux_2_28_$ARCH" \
    --platform "manylinux_2_27_$ARCH" --platform "manylinux_2_24_$ARCH" \
    --platform "manylinux_2_17_$ARCH" --platform "manylinux2014_$ARCH" "$@"
  rm -rf "$dir"/ray/jars "$dir"/bin  # Ray's Java support and console scripts are not used
  tar -C "$dir" -cf - . | xz -9 -T0 > ".gpu_pack/$name.tar.xz"
  rm -rf "$dir"
  local mib=$(( $(stat -c %s ".gpu_pack/$name.tar.xz") / 1048576 ))
  echo ".gpu_pack/$name.tar.xz: $mib MiB"
  if [ "$mib" -gt "$LIMIT_MIB" ]; then
    echo "error: .gpu_pack/$name.tar.xz is over $LIMIT_MIB MiB" >&2
    exit 1
  fi
}
pack engine "${ENGINE[@]}"
pack trainer "${TRAINER[@]}"
