import type { IncomingMessage, ServerResponse } from 'node:http';
import type { Socket } from 'node:net';

/** What a closing connection still reads of its client's bytes, and how long, before it closes. */
const LINGER_BYTES = 4 * 1024 * 1024;
const LINGER_MS = 2000;

/**
 * For an error answered before the request's body was read to its end (a 413 past a limit, a body
 * that is not the gzip it says, an import line refused): the connection closes after the answer.
 * Kept alive, it was stuck: a body the app began to read and left (its reader stopped at the
 * error) is not discarded by Node, so its rest stayed in the socket and the next request on the
 * connection was never answered (the client saw a reset at the keep-alive timeout).
 *
 * The client may still be sending when the answer is written. Closed at once (Node destroys the
 * socket once the answer is out), the kernel answers its unread bytes with a reset, which often
 * reached the client before the answer (curl: "send failure", Node: EPIPE, no status). So the
 * answer is followed by the end of our side, and what the client still sends is read and dropped,
 * never parsed (it is no request), until it closes its side, LINGER_BYTES have come or LINGER_MS
 * have passed.
 *
 * A body nobody began to read is left to Node, which discards it and keeps the connection (a 401
 * before the body is read), unless the answer closes the connection anyway; so is one that has
 * arrived whole.
 */
export function closeOverUnreadBody(req: IncomingMessage, res: ServerResponse): void {
  if (res.headersSent || req.readableEnded) return;
  const closing = res.getHeader('connection') === 'close';
  if (!req.readableDidRead && !closing) return;
  // All of it has arrived (the requests after it are parsed already, and would run unanswered on
  // a closed connection): what is left of it is dropped, and the connection goes on.
  if (req.complete && !closing) {
    req.resume();
    return;
  }
  res.setHeader('connection', 'close');
  const socket = req.socket as Socket | null;
  if (req.complete || !socket || socket.destroyed) return;
  // Node's server ends a closing connection's socket with destroySoon once the answer is written.
  socket.destroySoon = () => lingerThenClose(socket);
}

function lingerThenClose(socket: Socket): void {
  if (socket.destroyed) return;
  const close = () => {
    clearTimeout(timer);
    socket.destroy();
  };
  const timer = setTimeout(close, LINGER_MS);
  timer.unref();
  socket.end();
  // The HTTP parser's listener goes first: the bytes that follow are the refused body's, and
  // parsed, what comes after it would be run as a request of its own.
  socket.removeAllListeners('data');
  let left = LINGER_BYTES;
  socket.on('data', (chunk: Buffer) => {
    left -= chunk.length;
    if (left <= 0) close();
  });
  socket.once('end', close);
  socket.once('close', () => clearTimeout(timer));
  socket.resume();
}
