/* mplane: listen handle encoding (see handle.h). */
#include "handle.h"

#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void put_u16(uint8_t *p, uint16_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
}
static void put_u32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put_u64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint16_t get_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static uint32_t get_u32(const uint8_t *p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
  return v;
}
static uint64_t get_u64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
  return v;
}

ncclResult_t mplane_handle_encode(const struct mplane_handle *h, void *buf) {
  if (h->payload_len > MPLANE_HANDLE_PAYLOAD_MAX) return ncclInternalError;
  uint8_t *p = buf;
  memset(p, 0, MPLANE_HANDLE_SIZE);
  put_u32(p, MPLANE_HANDLE_MAGIC);
  put_u16(p + 4, h->version);
  p[6] = h->transport;
  p[7] = (uint8_t)h->plane;
  put_u64(p + 8, h->node_id);
  p[16] = h->payload_len;
  memcpy(p + MPLANE_HANDLE_HEADER, h->payload, h->payload_len);
  return ncclSuccess;
}

ncclResult_t mplane_handle_decode(const void *buf, struct mplane_handle *h, char *why, size_t whylen) {
  const uint8_t *p = buf;
  memset(h, 0, sizeof(*h));
  uint32_t magic = get_u32(p);
  if (magic != MPLANE_HANDLE_MAGIC) {
    snprintf(why, whylen, "not an mplane handle (magic 0x%08x, expected 0x%08x): is every rank using "
             "NCCL_NET_PLUGIN=mplane?", magic, MPLANE_HANDLE_MAGIC);
    return ncclInvalidUsage;
  }
  h->version = get_u16(p + 4);
  if (h->version != MPLANE_PROTOCOL_VERSION) {
    snprintf(why, whylen, "peer speaks mplane protocol version %u, this library speaks %u: use the same "
             "mplane build on every node", h->version, MPLANE_PROTOCOL_VERSION);
    return ncclInvalidUsage;
  }
  h->transport = p[6];
  h->plane = (int8_t)p[7];
  h->node_id = get_u64(p + 8);
  h->payload_len = p[16];
  if (h->transport != MPLANE_HANDLE_SOCKET && h->transport != MPLANE_HANDLE_IB) {
    snprintf(why, whylen, "handle names unknown transport %u", h->transport);
    return ncclInvalidUsage;
  }
  if (h->payload_len > MPLANE_HANDLE_PAYLOAD_MAX) {
    snprintf(why, whylen, "handle payload length %u exceeds %d", h->payload_len, MPLANE_HANDLE_PAYLOAD_MAX);
    return ncclInvalidUsage;
  }
  memcpy(h->payload, p + MPLANE_HANDLE_HEADER, h->payload_len);
  return ncclSuccess;
}

uint64_t mplane_hash64(const void *data, size_t len, uint64_t seed) {
  const uint8_t *p = data;
  uint64_t h = 0xcbf29ce484222325ull ^ seed;
  for (size_t i = 0; i < len; i++) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

static uint64_t node_id;
static pthread_once_t node_once = PTHREAD_ONCE_INIT;

static void compute_node_id(void) {
  const char *hostid = getenv("NCCL_HOSTID");
  if (hostid && *hostid) {
    node_id = mplane_hash64(hostid, strlen(hostid), 1);
    return;
  }
  char buf[512] = {0};
  gethostname(buf, 255);
  size_t n = strlen(buf);
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  if (f) {
    if (fgets(buf + n, (int)(sizeof(buf) - n), f) == NULL) buf[n] = 0;
    fclose(f);
  }
  node_id = mplane_hash64(buf, strlen(buf), 1);
}

uint64_t mplane_node_id(void) {
  pthread_once(&node_once, compute_node_id);
  return node_id;
}

ncclResult_t mplane_handle_sockaddr(const struct mplane_handle *h, struct sockaddr_storage *ss, socklen_t *len,
                                    char *why, size_t whylen) {
  memset(ss, 0, sizeof(*ss));
  sa_family_t family = 0;
  if (h->payload_len >= sizeof(family)) memcpy(&family, h->payload, sizeof(family));
  size_t want = family == AF_INET ? sizeof(struct sockaddr_in) : family == AF_INET6 ? sizeof(struct sockaddr_in6) : 0;
  if (want == 0 || h->payload_len != want) {
    snprintf(why, whylen, "the handle's address is not IPv4 or IPv6 (family %u, %u bytes): a handle from another "
             "build, or corrupted", (unsigned)family, (unsigned)h->payload_len);
    return ncclInvalidUsage;
  }
  memcpy(ss, h->payload, want);
  *len = (socklen_t)want;
  return ncclSuccess;
}
