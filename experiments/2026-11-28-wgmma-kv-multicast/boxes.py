"""Does a K tile loaded as two half boxes land as the one whole box does? For each swizzle and
tile, a kernel loads a [rows x 64] fp16 tile of a [1, 1, 256, 64] tensor with TMA, one box per
panel (whole) or two boxes of rows / 2 per panel at rows / 2 x swizzle bytes apart (halves),
then copies its shared memory out as it lies; the two byte images are compared.
    python experiments/2026-11-28-wgmma-kv-multicast/boxes.py"""

import sys
from pathlib import Path

import cupy
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from evoengine.launch.tma import encode_tensor_map, tma_geometry  # noqa: E402

SOURCE = r"""
struct __align__(64) TmaMap { unsigned long long opaque[16]; };
extern "C" __global__ void load(const TmaMap* map, unsigned char* out, int rows, int halves,
                                int sw, int bytes) {
  extern __shared__ __align__(1024) unsigned char smem[];
  __shared__ __align__(8) unsigned long long bar;
  const unsigned at = (unsigned)__cvta_generic_to_shared(smem), base = (at + 1023) & ~1023u;
  const unsigned b = (unsigned)__cvta_generic_to_shared(&bar);
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(b));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(bytes));
    const int panel = sw / 2, panels = 64 / panel, box = rows / halves;
    for (int p = 0; p < panels; ++p)
      for (int h = 0; h < halves; ++h) {
        unsigned dst = base + p * rows * sw + h * box * sw;
        asm volatile(
            "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
            " [%0], [%1, {%2, %3, %4, %5}], [%6];" ::"r"(dst), "l"(map), "r"(p * panel),
            "r"(h * box), "r"(0), "r"(0), "r"(b) : "memory");
      }
  }
  asm volatile("{\n.reg .pred p;\nW: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], 0;\n"
               "@!p bra W;\n}" ::"r"(b) : "memory");
  for (int i = threadIdx.x; i < bytes; i += blockDim.x) out[i] = smem[base - at + i];
}
"""


def main() -> None:
    mod = cupy.RawModule(code=SOURCE, options=("-arch=sm_90a", "-std=c++17"))
    fn = mod.get_function("load")
    x = torch.randint(-30000, 30000, (1, 1, 256, 64), dtype=torch.int16, device="cuda")
    x = x.view(torch.float16)  # distinct bit patterns, compared as bytes
    bad = 0
    for sw in (32, 64, 128):
        for rows in (64, 96, 128):
            images = []
            for halves in (1, 2):
                geo = tma_geometry(tuple(x.shape), x.stride(), 2, rows // halves, sw)
                raw = encode_tensor_map(x.data_ptr(), geo, "fp16")
                map_dev = cupy.asarray(bytearray(raw), dtype=cupy.uint8)
                nbytes = rows * 64 * 2
                out = cupy.zeros(nbytes, dtype=cupy.uint8)
                fn((1,), (128,), (map_dev, out, cupy.int32(rows), cupy.int32(halves),
                                  cupy.int32(sw), cupy.int32(nbytes)), shared_mem=nbytes + 1024)
                cupy.cuda.Device().synchronize()
                images.append(out.get())
            same = (images[0] == images[1]).all()
            bad += not same
            diff = (images[0] != images[1]).nonzero()[0]
            print(f"swizzle {sw:3} rows {rows:3}: halves {'==' if same else '!='} whole"
                  + ("" if same else f" (first differing byte {diff[0]}, {len(diff)} bytes)"))
    print("all equal" if not bad else f"{bad} differ")


if __name__ == "__main__":
    main()
