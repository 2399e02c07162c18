/* Fuzz target: the IB receiver's bookkeeping of what a peer's RDMA writes claim (net/ib/ib_data.c),
 * both pure functions: mpib_recv_entry_accept counts the chunks (byte_len, imm) of a receive's
 * entries, and mpib_fifo_take reads a FIFO slot the peer wrote into the sender's memory.
 *
 * Input, first byte even: accounting. Then 8 entry sizes (u32 each; an entry's size is its value
 * modulo 2^(5 + byte 1 % 28), so small and large buffers both come up), then records of 12 bytes:
 * byte_len (u32), imm (u32), and the high half of the adaptive-routing length record (u32; its low
 * half is byte_len) that a chunk with MPIB_IMM_AR reads instead of byte_len. The record's entry
 * is MPIB_IMM_ENTRY(imm). Properties, against a model kept here: an entry's bytes never exceed its
 * size; a refused chunk changes nothing; an accepted one adds exactly its length and a chunk index
 * not seen before, below a count every chunk of the message agrees on; an entry completes at most
 * once and only when every index 0..nchunks-1 came exactly once; nothing is accepted after the
 * entry completed or took a "does not fit" notice, and such a notice is accepted only before data.
 *
 * First byte odd: the FIFO. Then 2 bytes, 2 bits per element: unless 0, the element's seq is set to
 * seq + 1 (so that whole slots come up), then the sequence asked for (u64) and a struct
 * mpib_fifo_wire (8 elements of 64 bytes). Property: the result is exactly what the wire says:
 * 0 while element 0 or any of the n elements lacks seq + 1, -1 for n (element 0's nreqs) outside
 * 1..8 or elements that disagree on n, else 1 with the n entries copied. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "net/ib/ib.h"

#define MPIB_LENS_ALL (MPIB_MAX_REQS * MPIB_MAX_RECVS * MPIB_MAX_QPS)

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  fuzz_quiet();
  return 0;
}

struct model {
  uint64_t bytes, cap;
  unsigned nchunks, chunks;
  uint32_t seen;
  int trunc, completed_once;
};

static void accounting(const uint8_t *d, size_t n) {
  if (n < 2 + 8 * 4) return;
  unsigned bits = 5 + d[1] % 28;
  uint64_t mask = (1ull << bits) - 1;
  d += 2, n -= 2;
  static struct mpib_recv_comm c; /* only lens is read */
  static uint64_t lens[MPIB_LENS_ALL];
  c.lens = lens;
  struct mpib_recv_entry en[MPIB_MAX_RECVS];
  struct model m[MPIB_MAX_RECVS];
  memset(en, 0, sizeof(en));
  memset(m, 0, sizeof(m));
  for (int i = 0; i < MPIB_MAX_RECVS; i++) {
    uint32_t v;
    memcpy(&v, d + 4 * i, 4);
    en[i].cap = m[i].cap = v & mask;
    en[i].tag = i;
  }
  d += 32, n -= 32;
  for (; n >= 12; d += 12, n -= 12) {
    uint32_t byte_len, imm, hi;
    memcpy(&byte_len, d, 4);
    memcpy(&imm, d + 4, 4);
    memcpy(&hi, d + 8, 4);
    unsigned e = MPIB_IMM_ENTRY(imm), chunk = MPIB_IMM_CHUNK(imm), nch = MPIB_IMM_NCHUNKS(imm);
    uint64_t len = byte_len;
    if (imm & MPIB_IMM_AR) {
      len = (uint64_t)hi << 32 | byte_len;
      lens[(MPIB_IMM_SLOT(imm) * MPIB_MAX_RECVS + e) * MPIB_MAX_QPS + chunk] = len;
    }
    struct mpib_recv_entry before = en[e];
    struct model *mm = &m[e];
    const char *bad = mpib_recv_entry_accept(&c, &en[e], byte_len, imm);
    int complete_before = mm->nchunks && mm->chunks == mm->nchunks;

    /* the model's verdict */
    int refuse;
    if (mm->trunc || complete_before) refuse = 1;
    else if (imm & MPIB_IMM_TRUNC) refuse = mm->chunks > 0;
    else
      refuse = (mm->chunks && mm->nchunks != nch) || chunk >= nch || (mm->seen >> chunk & 1) ||
               len > mm->cap - mm->bytes;
    FUZZ_REQUIRE((bad != NULL) == refuse,
                 "entry %u, chunk %u of %u, %llu bytes (cap %llu, %llu so far, %u chunks of %u, trunc %d), imm "
                 "0x%08x: the plugin %s it (%s)", e, chunk, nch, (unsigned long long)len,
                 (unsigned long long)mm->cap, (unsigned long long)mm->bytes, mm->chunks, mm->nchunks, mm->trunc, imm,
                 bad ? "refused" : "accepted", bad ? bad : "");
    if (bad) {
      FUZZ_REQUIRE(memcmp(&before, &en[e], sizeof(before)) == 0, "a refused chunk (%s) changed the entry", bad);
      continue;
    }
    if (imm & MPIB_IMM_TRUNC) {
      mm->trunc = 1;
      FUZZ_REQUIRE(en[e].trunc && en[e].bytes == 0 && en[e].chunks == 0, "a 'does not fit' notice was not recorded");
      continue;
    }
    mm->nchunks = nch;
    mm->seen |= 1u << chunk;
    mm->chunks++;
    mm->bytes += len;
    FUZZ_REQUIRE(en[e].bytes == mm->bytes && en[e].bytes <= en[e].cap,
                 "entry %u holds %llu bytes (model %llu, cap %llu)", e, (unsigned long long)en[e].bytes,
                 (unsigned long long)mm->bytes, (unsigned long long)en[e].cap);
    FUZZ_REQUIRE(en[e].chunks == (int)mm->chunks && en[e].nchunks == (int)nch && en[e].chunk_mask == mm->seen,
                 "entry %u: %d chunks of %d, mask 0x%x (model %u of %u, 0x%x)", e, en[e].chunks, en[e].nchunks,
                 en[e].chunk_mask, mm->chunks, nch, mm->seen);
    int complete = en[e].nchunks && en[e].chunks == en[e].nchunks;
    if (complete) {
      FUZZ_REQUIRE(!mm->completed_once, "entry %u completed twice", e);
      mm->completed_once = 1;
      FUZZ_REQUIRE(en[e].chunk_mask == (nch == 32 ? ~0u : (1u << nch) - 1),
                   "entry %u complete with chunk mask 0x%x for %u chunks", e, en[e].chunk_mask, nch);
    }
  }
}

static void fifo(const uint8_t *d, size_t n) {
  struct mpib_fifo_wire w;
  uint64_t seq;
  if (n < 3 + sizeof(seq)) return;
  unsigned landed = d[1] | (unsigned)d[2] << 8;
  memcpy(&seq, d + 3, sizeof(seq));
  d += 3 + sizeof(seq), n -= 3 + sizeof(seq);
  memset(&w, 0, sizeof(w));
  memcpy(&w, d, n < sizeof(w) ? n : sizeof(w));
  for (int i = 0; i < MPIB_MAX_RECVS; i++) /* 2 bits per element: 0 leaves the wire's own seq */
    if ((landed >> (2 * i) & 3) != 0) w.e[i].seq = seq + 1;
  uint32_t nreq = w.e[0].nreqs;
  int want;
  if (w.e[0].seq != seq + 1) want = 0;
  else if (nreq < 1 || nreq > MPIB_MAX_RECVS) want = -1;
  else {
    want = 1;
    for (uint32_t i = 1; i < nreq && want == 1; i++)
      if (w.e[i].seq != seq + 1) want = 0;
    for (uint32_t i = 0; i < nreq && want == 1; i++)
      if (w.e[i].nreqs != nreq) want = -1;
  }
  struct mpib_fifo_slot out;
  memset(&out, 0xee, sizeof(out));
  int got = mpib_fifo_take(&w, seq, &out);
  FUZZ_REQUIRE(got == want, "mpib_fifo_take for seq %llu returned %d, the wire says %d (element 0: seq %llu, n %u)",
               (unsigned long long)seq, got, want, (unsigned long long)w.e[0].seq, nreq);
  if (got != 1) return;
  FUZZ_REQUIRE(out.n == nreq && out.rec_rkey == w.e[0].rec_rkey && out.rec_addr == w.e[0].rec_addr,
               "slot taken with n %u (wire %u)", out.n, nreq);
  for (uint32_t i = 0; i < nreq; i++)
    FUZZ_REQUIRE(out.e[i].addr == w.e[i].addr && out.e[i].size == w.e[i].size && out.e[i].rkey == w.e[i].rkey &&
                     out.e[i].tag == w.e[i].tag,
                 "entry %u of the slot taken differs from the wire", i);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  if (data[0] & 1) fifo(data, size);
  else accounting(data, size);
  return 0;
}
