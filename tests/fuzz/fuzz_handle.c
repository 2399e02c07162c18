/* Fuzz target: the listen-handle decoder (net/handle.c). NCCL hands the plugin whatever bytes a
 * peer sent as its handle: a handle either decodes, re-encodes to the same bytes and yields an
 * address of exactly its family's length, or is refused with a reason. */
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "net/handle.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  fuzz_quiet();
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  uint8_t buf[MPLANE_HANDLE_SIZE];
  memset(buf, 0, sizeof(buf));
  memcpy(buf, data, size < sizeof(buf) ? size : sizeof(buf));
  struct mplane_handle h;
  char why[512] = "";
  if (mplane_handle_decode(buf, &h, why, sizeof(why)) != ncclSuccess) {
    FUZZ_REQUIRE(why[0] != '\0', "refused without a reason");
    return 0;
  }
  FUZZ_REQUIRE(h.payload_len <= MPLANE_HANDLE_PAYLOAD_MAX, "payload length %u", h.payload_len);
  uint8_t again[MPLANE_HANDLE_SIZE];
  FUZZ_REQUIRE(mplane_handle_encode(&h, again) == ncclSuccess, "a decoded handle does not encode");
  struct mplane_handle h2;
  FUZZ_REQUIRE(mplane_handle_decode(again, &h2, why, sizeof(why)) == ncclSuccess, "re-encoded handle refused: %s", why);
  FUZZ_REQUIRE(h2.payload_len == h.payload_len && memcmp(h2.payload, h.payload, h.payload_len) == 0 &&
                   h2.node_id == h.node_id && h2.plane == h.plane && h2.transport == h.transport,
               "round trip changed the handle");
  struct sockaddr_storage ss;
  socklen_t len = 0;
  if (mplane_handle_sockaddr(&h, &ss, &len, why, sizeof(why)) == ncclSuccess) {
    FUZZ_REQUIRE((ss.ss_family == AF_INET && len == sizeof(struct sockaddr_in)) ||
                     (ss.ss_family == AF_INET6 && len == sizeof(struct sockaddr_in6)),
                 "family %d length %u", ss.ss_family, (unsigned)len);
  }
  return 0;
}
