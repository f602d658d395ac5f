"""``ldmatrix`` fragment loads from swizzled or linear shared tiles (x2 or x4, ``.trans`` for V).

An 8×8 b16 matrix is read from 8 row addresses of 16 bytes; ``.x4`` reads 4 matrices (row
addresses from lanes 0-7, 8-15, 16-23, 24-31), ``.x2`` two (lanes 0-15). After the load,
lane ``l`` holds elements ``(l / 4, 2·(l % 4) + {0,1})`` of each matrix (transposed with
``.trans``). The fragment loaders below place those matrices so that they are the A and B
operands of ``mma.m16n8k16``:

* A (Q, 16 rows × k16): matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15),
  (rows 8-15, k 8-15) → a[0..3].
* B from K (keys × head dim, "col" operand as stored): for one n8 tile, (keys, k 0-7) and
  (keys, k 8-15) → b[0], b[1]; x4 covers two n8 tiles.
* B from V (keys × head dim, needs keys along k): ``.trans`` of (keys 0-7, dims), (keys 8-15,
  dims) → b[0], b[1]; x4 covers two n8 tiles of head dims.

Addressing: a lane's offset is computed once for k-step 0 (``smem_offset`` of its row, chunk
0 or 1); step ``kk`` (chunk ``+2·kk``) is reached by XOR-ing ``kk << 5`` into that offset.
That is exact for both layouts: the swizzle is itself an XOR of the chunk bits with
``row % 8`` (XORs commute), the linear layout has those bits zero (XOR = add), and rows are
multiples of 8 apart (``row0``, ``key0``, ``16·kk`` add whole rows without changing
``row % 8``). So the per-step offsets are register-free immediates or one LOP3.

K and V tiles in 64-column TMA boxes (rows of 128 bytes with the same XOR swizzle, see
:meth:`cherenkov.codegen.plan.FlashLayout.kv_chunk_offset`): k-step ``kk`` of K reads box
``kk / 4`` at chunk ``2·(kk % 4)``, head dims ``dim0`` of V box ``dim0 / 64`` at chunk
``(dim0 % 64) / 8``: a whole-box offset plus the same XOR inside the box.

Needs ``smem_offset`` and ``ROW_BYTES`` (and ``BOX_ROW_BYTES``, ``KV_BOX_BYTES`` for boxed
K/V tiles).
"""

from __future__ import annotations

from cherenkov.codegen.cuda.text import block
from cherenkov.codegen.errors import CodegenError


def emit_ldmatrix_primitives(width: int) -> str:
    """ldmatrix of ``width`` (2 or 4) matrices, plain and transposed."""
    regs = ", ".join(f"%{i}" for i in range(width))
    outs = ", ".join(f'"=r"(r[{i}])' for i in range(width))
    return block(
        f"""
        // Load {width} 8x8 b16 matrices from shared memory (one row address per lane).
        __device__ __forceinline__ void ldmatrix_x{width}(u32 (&r)[{width}], u32 addr) {{
            asm volatile("ldmatrix.sync.aligned.m8n8.x{width}.shared.b16 {{{regs}}}, [%{width}];\\n"
                         : {outs} : "r"(addr));
        }}

        // The same, each matrix transposed.
        __device__ __forceinline__ void ldmatrix_x{width}_trans(u32 (&r)[{width}], u32 addr) {{
            asm volatile("ldmatrix.sync.aligned.m8n8.x{width}.trans.shared.b16 {{{regs}}}, [%{width}];\\n"
                         : {outs} : "r"(addr));
        }}
        """
    )


_LOAD_A_X4 = block(
    """
    // A operand: rows [row0, row0 + 16) x columns [16 * kk, 16 * kk + 16), one ldmatrix.x4.
    __device__ __forceinline__ void load_a(u32 (&a)[4], u32 tile, int row0, int kk, int lane) {
        ldmatrix_x4(a, tile + row0 * ROW_BYTES + (smem_offset(lane & 15, lane >> 4) ^ (kk << 5)));
    }
    """
)


def emit_fragment_loaders(width: int, kv_boxes: int = 0) -> str:
    """``load_a``, ``load_b_k`` and ``load_b_v``: mma operands of 16×16 tiles of a shared tile;
    ``kv_boxes`` (x4 only): K and V tiles are that many 64-column TMA boxes. One box (head dim
    64) is laid out like a cp.async tile (128-byte rows, the same swizzle), so it is read
    with the plain loaders."""
    if kv_boxes > 1:
        if width != 4:
            raise CodegenError(f"K/V tiles in TMA boxes are read with ldmatrix x4 (got x{width})")
        return _LOAD_A_X4 + "\n\n" + _emit_boxed_b_loaders()
    if width == 4:
        return _LOAD_A_X4 + "\n\n" + block(
            """
            // B operands of the two n8 tiles of keys [key0, key0 + 16) at k-step kk (K is stored
            // keys x dims, which is the "col" layout mma wants): b[0..1] tile key0, b[2..3] key0 + 8.
            __device__ __forceinline__ void load_b_k(u32 (&b)[4], u32 tile, int key0, int kk, int lane) {
                const u32 lane_offset = smem_offset((lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
                ldmatrix_x4(b, tile + key0 * ROW_BYTES + (lane_offset ^ (kk << 5)));
            }

            // B operands of the two n8 tiles of head dims [dim0, dim0 + 16) over keys
            // [16 * kk, 16 * kk + 16): V is keys x dims, so it is loaded transposed.
            __device__ __forceinline__ void load_b_v(u32 (&b)[4], u32 tile, int kk, int dim0, int lane) {
                ldmatrix_x4_trans(b, tile + 16 * kk * ROW_BYTES + (smem_offset(lane & 15, lane >> 4) ^ (dim0 << 1)));
            }
            """
        )
    return block(
        """
        // A operand: rows [row0, row0 + 16) x columns [16 * kk, 16 * kk + 16), two ldmatrix.x2
        // (columns 0-7, then 8-15; lanes 0-15 give the row addresses).
        __device__ __forceinline__ void load_a(u32 (&a)[4], u32 tile, int row0, int kk, int lane) {
            u32 lo[2], hi[2];
            ldmatrix_x2(lo, tile + row0 * ROW_BYTES + (smem_offset(lane & 15, 0) ^ (kk << 5)));
            ldmatrix_x2(hi, tile + row0 * ROW_BYTES + (smem_offset(lane & 15, 1) ^ (kk << 5)));
            a[0] = lo[0]; a[1] = lo[1]; a[2] = hi[0]; a[3] = hi[1];
        }

        // B operands of the two n8 tiles of keys [key0, key0 + 16) at k-step kk, one ldmatrix.x2
        // per n8 tile: b[0..1] tile key0, b[2..3] tile key0 + 8.
        __device__ __forceinline__ void load_b_k(u32 (&b)[4], u32 tile, int key0, int kk, int lane) {
            const u32 lane_offset = smem_offset(lane & 7, (lane >> 3) & 1) ^ (kk << 5);
            u32 n0[2], n1[2];
            ldmatrix_x2(n0, tile + key0 * ROW_BYTES + lane_offset);
            ldmatrix_x2(n1, tile + (key0 + 8) * ROW_BYTES + lane_offset);
            b[0] = n0[0]; b[1] = n0[1]; b[2] = n1[0]; b[3] = n1[1];
        }

        // B operands of the two n8 tiles of head dims [dim0, dim0 + 16) over keys
        // [16 * kk, 16 * kk + 16), V loaded transposed, one ldmatrix.x2.trans per n8 tile.
        __device__ __forceinline__ void load_b_v(u32 (&b)[4], u32 tile, int kk, int dim0, int lane) {
            const u32 rows = tile + 16 * kk * ROW_BYTES;
            u32 n0[2], n1[2];
            ldmatrix_x2_trans(n0, rows + (smem_offset(lane & 15, 0) ^ (dim0 << 1)));
            ldmatrix_x2_trans(n1, rows + (smem_offset(lane & 15, 1) ^ (dim0 << 1)));
            b[0] = n0[0]; b[1] = n0[1]; b[2] = n1[0]; b[3] = n1[1];
        }
        """
    )


def _emit_boxed_b_loaders() -> str:
    return block(
        """
        // B operands of the two n8 tiles of keys [key0, key0 + 16) at k-step kk, from the K tile's
        // 64-column boxes (k-step kk: box kk / 4, chunks 2 (kk % 4) and 2 (kk % 4) + 1 of its rows):
        // b[0..1] tile key0, b[2..3] key0 + 8.
        __device__ __forceinline__ void load_b_k(u32 (&b)[4], u32 tile, int key0, int kk, int lane) {
            const int row = (lane & 7) + ((lane >> 4) << 3);
            const u32 lane_offset = u32(row) * BOX_ROW_BYTES + (u32(((lane >> 3) & 1) ^ (row & 7)) << 4);
            ldmatrix_x4(b, tile + (kk >> 2) * KV_BOX_BYTES + key0 * BOX_ROW_BYTES + (lane_offset ^ ((kk & 3) << 5)));
        }

        // B operands of the two n8 tiles of head dims [dim0, dim0 + 16) over keys
        // [16 * kk, 16 * kk + 16), loaded transposed from the V tile's box dim0 / 64.
        __device__ __forceinline__ void load_b_v(u32 (&b)[4], u32 tile, int kk, int dim0, int lane) {
            const int row = lane & 15;
            const int dp = dim0 >> 4;
            const u32 lane_offset = u32(row) * BOX_ROW_BYTES + (u32((lane >> 4) ^ (row & 7)) << 4);
            ldmatrix_x4_trans(b, tile + (dp >> 2) * KV_BOX_BYTES + 16 * kk * BOX_ROW_BYTES + (lane_offset ^ ((dp & 3) << 5)));
        }
        """
    )
