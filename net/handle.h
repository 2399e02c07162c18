/* mplane: the listen handle NCCL carries between ranks (at most NCCL_NET_HANDLE_MAXSIZE bytes).
 *
 * Layout, little endian, fixed: magic "MPLN" (4), protocol version (2), transport (1), plane (1,
 * signed), node id (8), payload length (1), payload (the transport's address, <= 111 bytes).
 * A handle that is not ours, or of another protocol version, is refused with a clear error before
 * anything connects. */
#ifndef MPLANE_NET_HANDLE_H
#define MPLANE_NET_HANDLE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include "../common/nccl/err.h"

#define MPLANE_HANDLE_MAGIC 0x4e4c504du /* "MPLN" read as little-endian u32 */
#define MPLANE_PROTOCOL_VERSION 6 /* 2: socket inline messages on the control socket; 3: eager ones; 4: filler after small ones; 5: spliced chunks acked; 6: lazy data streams */
#define MPLANE_HANDLE_SIZE 128
#define MPLANE_HANDLE_HEADER 17
#define MPLANE_HANDLE_PAYLOAD_MAX (MPLANE_HANDLE_SIZE - MPLANE_HANDLE_HEADER)

enum mplane_handle_transport { MPLANE_HANDLE_SOCKET = 1, MPLANE_HANDLE_IB = 2 };

struct mplane_handle {
  uint16_t version;
  uint8_t transport;
  int8_t plane;
  uint64_t node_id;
  uint8_t payload_len;
  uint8_t payload[MPLANE_HANDLE_PAYLOAD_MAX];
};

/* Write h into buf (MPLANE_HANDLE_SIZE bytes). Fails if the payload is too long. */
ncclResult_t mplane_handle_encode(const struct mplane_handle *h, void *buf);

/* Read buf into h. Fails with ncclInvalidUsage and a reason in why if buf is not an mplane handle,
 * is of another protocol version, or is inconsistent. */
ncclResult_t mplane_handle_decode(const void *buf, struct mplane_handle *h, char *why, size_t whylen);

/* The TCP address a socket or IB handle carries: AF_INET or AF_INET6 with exactly that family's
 * length, nothing else (another family would send our connection state to whatever it names; a
 * longer length would make connect() read past the address). Fails with a reason in why. */
ncclResult_t mplane_handle_sockaddr(const struct mplane_handle *h, struct sockaddr_storage *ss, socklen_t *len,
                                    char *why, size_t whylen);

/* This node's id: NCCL_HOSTID when set (so tests can emulate several nodes), else the hostname and
 * boot id, hashed. Stable for the process's life. */
uint64_t mplane_node_id(void);

/* FNV-1a, used for node ids and guids. */
uint64_t mplane_hash64(const void *data, size_t len, uint64_t seed);

#endif
