#!/usr/bin/env python3
"""Tiny AMQP 0-9-1 client for scripts/run.sh's demo (Python standard library only).

    amqp_demo.py declare EXCHANGE QUEUE   declare a durable fanout exchange and a durable queue,
                                          and bind the queue to the exchange
    amqp_demo.py drain QUEUE              print and acknowledge every message in the queue
    amqp_demo.py publish EXCHANGE BODY    publish one message (to check the queue by hand)

Connects to AMQP_HOST:AMQP_PORT (default 127.0.0.1:5672) as AMQP_USER/AMQP_PASSWORD
(guest/guest), vhost AMQP_VHOST (/). Only what the demo needs; not a general client.
"""
import os
import socket
import struct
import sys

FRAME_METHOD, FRAME_HEADER, FRAME_BODY, FRAME_END = 1, 2, 3, 0xCE


def shortstr(s):
    b = s.encode()
    return struct.pack("B", len(b)) + b


def longstr(b):
    return struct.pack(">I", len(b)) + b


EMPTY_TABLE = struct.pack(">I", 0)


class Amqp:
    def __init__(self, host, port, user, password, vhost):
        self.sock = socket.create_connection((host, port), timeout=10)
        self.buf = b""
        self.sock.sendall(b"AMQP\x00\x00\x09\x01")
        self.expect(0, 10, 10)  # connection.start
        self.method(0, 10, 11, EMPTY_TABLE + shortstr("PLAIN")
                    + longstr(("\0%s\0%s" % (user, password)).encode()) + shortstr("en_US"))
        _, _, args = self.expect(0, 10, 30)  # connection.tune
        channel_max, frame_max, _ = struct.unpack(">HIH", args[:8])
        self.method(0, 10, 31, struct.pack(">HIH", channel_max, frame_max, 0))  # no heartbeats
        self.method(0, 10, 40, shortstr(vhost) + shortstr("") + b"\x00")
        self.expect(0, 10, 41)  # connection.open-ok
        self.method(1, 20, 10, shortstr(""))
        self.expect(1, 20, 11)  # channel.open-ok

    def read_exact(self, n):
        while len(self.buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise SystemExit("amqp_demo: connection closed by the broker")
            self.buf += chunk
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def frame(self):
        ftype, channel, size = struct.unpack(">BHI", self.read_exact(7))
        payload = self.read_exact(size)
        if self.read_exact(1)[0] != FRAME_END:
            raise SystemExit("amqp_demo: bad frame end")
        return ftype, channel, payload

    def method(self, channel, cls, mth, args=b""):
        payload = struct.pack(">HH", cls, mth) + args
        self.sock.sendall(struct.pack(">BHI", FRAME_METHOD, channel, len(payload)) + payload
                          + bytes([FRAME_END]))

    def expect(self, channel, cls, *methods):
        while True:
            ftype, ch, payload = self.frame()
            if ftype != FRAME_METHOD:
                continue  # heartbeat
            c, m = struct.unpack(">HH", payload[:4])
            if (c, m) in ((10, 50), (20, 40)):  # connection.close / channel.close
                code = struct.unpack(">H", payload[4:6])[0]
                text = payload[7:7 + payload[6]].decode(errors="replace")
                raise SystemExit("amqp_demo: broker closed the %s: %d %s"
                                 % ("connection" if c == 10 else "channel", code, text))
            if ch == channel and c == cls and m in methods:
                return c, m, payload[4:]

    def close(self):
        self.method(0, 10, 50, struct.pack(">H", 200) + shortstr("bye") + struct.pack(">HH", 0, 0))
        try:
            self.expect(0, 10, 51)
        except (SystemExit, OSError):
            pass
        self.sock.close()


def main(argv):
    conn = Amqp(os.environ.get("AMQP_HOST", "127.0.0.1"), int(os.environ.get("AMQP_PORT", "5672")),
                os.environ.get("AMQP_USER", "guest"), os.environ.get("AMQP_PASSWORD", "guest"),
                os.environ.get("AMQP_VHOST", "/"))
    if len(argv) == 3 and argv[0] == "declare":
        exchange, queue = argv[1], argv[2]
        # exchange.declare: durable (bit 1), fanout
        conn.method(1, 40, 10, struct.pack(">H", 0) + shortstr(exchange) + shortstr("fanout")
                    + b"\x02" + EMPTY_TABLE)
        conn.expect(1, 40, 11)
        # queue.declare: durable (bit 1)
        conn.method(1, 50, 10, struct.pack(">H", 0) + shortstr(queue) + b"\x02" + EMPTY_TABLE)
        conn.expect(1, 50, 11)
        # queue.bind
        conn.method(1, 50, 20, struct.pack(">H", 0) + shortstr(queue) + shortstr(exchange)
                    + shortstr("") + b"\x00" + EMPTY_TABLE)
        conn.expect(1, 50, 21)
    elif len(argv) == 2 and argv[0] == "drain":
        queue, count = argv[1], 0
        for _ in range(10000):
            conn.method(1, 60, 70, struct.pack(">H", 0) + shortstr(queue) + b"\x00")  # basic.get
            _, m, args = conn.expect(1, 60, 71, 72)
            if m == 72:  # get-empty
                break
            tag = struct.unpack(">Q", args[:8])[0]
            _, _, header = conn.frame()
            size = struct.unpack(">Q", header[4:12])[0]
            body = b""
            while len(body) < size:
                _, _, chunk = conn.frame()
                body += chunk
            print(body.decode(errors="replace"))
            conn.method(1, 60, 80, struct.pack(">Q", tag) + b"\x00")  # basic.ack
            count += 1
        print("(%d message(s))" % count)
    elif len(argv) == 3 and argv[0] == "publish":
        body = argv[2].encode()
        conn.method(1, 60, 40, struct.pack(">H", 0) + shortstr(argv[1]) + shortstr("") + b"\x00")
        header = struct.pack(">HHQH", 60, 0, len(body), 0)
        conn.sock.sendall(struct.pack(">BHI", FRAME_HEADER, 1, len(header)) + header
                          + bytes([FRAME_END]))
        conn.sock.sendall(struct.pack(">BHI", FRAME_BODY, 1, len(body)) + body + bytes([FRAME_END]))
    else:
        conn.close()
        raise SystemExit(__doc__)
    conn.close()


if __name__ == "__main__":
    main(sys.argv[1:])
