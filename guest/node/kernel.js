'use strict';
// bud's JavaScript kernel: a warm Node.js that runs one-shot JavaScript jobs with
// `node -e CODE ARG...` semantics, and rings bud's doorbell itself.
//
// Why it holds the doorbell
// -------------------------
// A Node.js start in the guest costs ~15 s under kvm_pvm (mapping and relocating libnode,
// compiling its internal modules from source: Debian's node has no startup snapshot), and a
// hand-off through a pipe from the Python worker costs ~10-20 ms per job (a wake-up and two
// context switches, all emulated guest-kernel work). So the worker starts this kernel before
// READY (`guest/python/bud_runtime.py`), lets it warm up, and hands it the doorbell: this
// process rings READY, the template is snapshotted with the vCPU in it, and every clone
// resumes here. A JavaScript job then costs what a Python job costs: the request is read from
// the mailbox (the worker's memfd, mapped here too: the same guest-physical pages), the
// output goes into the mailbox's areas, and DONE is one `out`.
//
// A request for another runtime (Python, the shell, a file or process operation) is handed
// to the worker: one token byte on fd 5, then this process blocks reading fd 4 until the
// worker hands the doorbell back (a JavaScript request reached the worker). Whoever holds
// the doorbell rings DONE for the request it ran.
//
// The life of a job (`serve`)
// ---------------------------
// `serve` runs on the resume from a doorbell: it reads the request, gives the clone its own
// random streams (Math.random from the job's seed, OpenSSL's generator reseeded with it),
// sets argv and env, runs the code as `node -e` does (a script in the main context with
// `require`, `module`, `exports`, `__filename` = `[eval]`) and returns to the event loop.
// When the loop has nothing left, `beforeExit` finishes the job: exit code
// `process.exitCode`, DONE. `process.exit(n)` and an uncaught error finish it at once (the
// error printed as node prints it, exit code 1). A one-shot job's VM is reset after DONE, so
// nothing of a job (globals, timers, modules it required) reaches the next one.
//
// Output: `process.stdout`/`process.stderr` writes (so `console.*`) and `fs.writeSync` to
// fds 1 and 2 go straight into the mailbox areas, no syscalls. Output written below that (a
// child process that inherits fds 1 and 2) lands in this process's capture files, which are
// read into the areas at the end of a job that started child processes.
//
// Dialects: the template may name other languages this kernel runs (`BUD_DIALECTS`, from
// the recipe's `[[site.runtime.dialects]]`); a request's JOB_DIALECT n >= 1 is written in
// the n-th. Each is turned into JavaScript first, keeping its lines where they were (so a
// stack points at the user's line): TypeScript by sucrase, which strips the types and
// checks none (as `tsc --noCheck`, tsx or node's --experimental-strip-types do).
//
// The host's interrupt (a cell or job past its time): the worker's interrupt watcher sends
// this process SIGINT, then SIGUSR2, for a kernel request. Code running synchronously from
// the request (a loop in a cell or job) is stopped by V8 on the SIGINT (`breakOnSigint`),
// with node's own ERR_SCRIPT_EXECUTION_INTERRUPTED error; a request waiting in the event
// loop (a timer, a promise) is ended by the SIGUSR2 handler with the same error. The request
// then ends as an uncaught error would (a cell's session goes on). Not interruptible: a
// synchronous loop in a callback the loop runs later (after an `await`, in a timer); the
// host ends that session after its grace.
//
// node's SIGINT watchdog (what `breakOnSigint` uses) is started once in the warm-up and
// never stopped: each `breakOnSigint` run would otherwise start and join a thread of its
// own (measured: ~30 ms of emulated guest-kernel work per job, 151 us natively). While it
// runs, SIGINT is the watchdog's (a SIGINT with no code to stop is only noted), hence the
// second signal.

const fs = require('fs');
const path = require('path');
const vm = require('vm');
const util = require('util');
const Module = require('module');
const childProcess = require('child_process');

// The addon (guest/nodeext); BUD_KERNEL_ADDON names another (a fake host, in host tests).
const addon = require(process.env.BUD_KERNEL_ADDON || path.join(__dirname, 'bud.node'));
delete process.env.BUD_KERNEL_ADDON;

// What the worker gives: the protocol's constants (from `_bud`, which has them from
// protocol.rs), the mailbox memfd, the token pipes.
const P = JSON.parse(process.env.BUD_PROTOCOL);
delete process.env.BUD_PROTOCOL;
const MAILBOX_FD = 3;
const TOKEN_IN = 4;
const TOKEN_OUT = 5;
const TOKEN_TO_WORKER = 0x4a; // 'J'
const TOKEN_READY = 0x52; // 'R'
const TOKEN_RESEED = 0x53; // 'S'
const EXITED = P.OUTCOME_EXITED;

// ---- the mailbox

let box = null; // Uint8Array over the mailbox
let dv = null; // DataView over it

function u32(at) {
  return dv.getUint32(at, true);
}

function setU32(at, value) {
  dv.setUint32(at, value >>> 0, true);
}

// ---- output areas

const STREAMS = [
  { lenAt: P.RESULT_STDOUT_LEN, start: P.RESULT_STDOUT_AREA, end: P.RESULT_STDOUT_AREA_END },
  { lenAt: P.RESULT_STDERR_LEN, start: P.RESULT_STDERR_AREA, end: P.RESULT_STDERR_AREA_END },
];

let ring = (code, a, b) => addon.ring(code, a, b);

// Appends bytes to stream 0 (stdout) or 1 (stderr), ringing FLUSH whenever its area is full.
function emit(which, bytes) {
  const s = STREAMS[which];
  let off = 0;
  while (off < bytes.length) {
    const used = u32(s.lenAt);
    const room = s.end - s.start - used;
    if (room <= 0) {
      ring(P.FLUSH, 0, 0);
      continue;
    }
    const n = Math.min(room, bytes.length - off);
    box.set(bytes.subarray(off, off + n), s.start + used);
    setU32(s.lenAt, used + n);
    off += n;
  }
}

function toBytes(chunk, encoding) {
  if (typeof chunk === 'string') {
    return Buffer.from(chunk, typeof encoding === 'string' ? encoding : 'utf8');
  }
  if (chunk instanceof Uint8Array) return chunk;
  if (ArrayBuffer.isView(chunk)) return new Uint8Array(chunk.buffer, chunk.byteOffset, chunk.byteLength);
  throw new TypeError('The "chunk" argument must be of type string or an instance of Buffer or Uint8Array');
}

function streamWrite(which) {
  return function write(chunk, encoding, callback) {
    if (typeof encoding === 'function') {
      callback = encoding;
      encoding = undefined;
    }
    emit(which, toBytes(chunk, encoding));
    if (typeof callback === 'function') process.nextTick(callback);
    return true;
  };
}

// fs.writeSync / fs.write / fs.writeFileSync to fds 1 and 2 go to the areas too.
const realWriteSync = fs.writeSync;
const realWrite = fs.write;
fs.writeSync = function writeSync(fd, buffer, ...rest) {
  if (fd === 1 || fd === 2) {
    const bytes = bytesOf(buffer, rest);
    emit(fd - 1, bytes);
    return bytes.length;
  }
  return realWriteSync.call(fs, fd, buffer, ...rest);
};
fs.write = function write(fd, buffer, ...rest) {
  if (fd === 1 || fd === 2) {
    const callback = rest.pop();
    const bytes = bytesOf(buffer, rest);
    emit(fd - 1, bytes);
    process.nextTick(callback, null, bytes.length, buffer);
    return undefined;
  }
  return realWrite.call(fs, fd, buffer, ...rest);
};

// What fs.writeSync(fd, buffer, ...rest) / fs.write would write: a string in its encoding
// (`(string[, position[, encoding]])`), or the slice of a buffer that `rest` names
// (`(buffer[, offset[, length]])` or `(buffer, { offset, length })`).
function bytesOf(buffer, rest) {
  if (typeof buffer === 'string') {
    return Buffer.from(buffer, typeof rest[1] === 'string' ? rest[1] : 'utf8');
  }
  const bytes = toBytes(buffer);
  let offset = 0;
  let length = bytes.length;
  if (rest[0] !== null && typeof rest[0] === 'object') {
    offset = rest[0].offset ?? 0;
    length = rest[0].length ?? bytes.length - offset;
  } else {
    if (typeof rest[0] === 'number') offset = rest[0];
    length = typeof rest[1] === 'number' ? rest[1] : bytes.length - offset;
  }
  return bytes.subarray(offset, offset + length);
}

process.stdout.write = streamWrite(0);
process.stderr.write = streamWrite(1);

// Child processes write to fds 1 and 2 themselves (the capture files): a job that starts one
// has them read into the areas at its end (`collectFdOutput`).
let childStarted = false;
const fdStart = [0, 0];
for (const name of ['spawn', 'spawnSync', 'exec', 'execSync', 'execFile', 'execFileSync', 'fork']) {
  const real = childProcess[name];
  childProcess[name] = function (...args) {
    if (!childStarted) {
      childStarted = true;
      fdStart[0] = fs.fstatSync(1).size;
      fdStart[1] = fs.fstatSync(2).size;
    }
    return real.apply(this, args);
  };
}

function collectFdOutput() {
  if (!childStarted) return;
  for (const fd of [1, 2]) {
    const size = fs.fstatSync(fd).size;
    const from = fdStart[fd - 1];
    if (size > from) {
      const buf = Buffer.allocUnsafe(size - from);
      const n = fs.readSync(fd, buf, 0, buf.length, from);
      emit(fd - 1, buf.subarray(0, n));
    }
  }
}

// ---- the request

function readRequest() {
  const lang = u32(P.JOB_LANGUAGE);
  const codeLen = u32(P.JOB_CODE_LEN);
  const stdinLen = u32(P.JOB_STDIN_LEN);
  const argsLen = u32(P.JOB_ARGS_LEN);
  const envLen = u32(P.JOB_ENV_LEN);
  const total = codeLen + stdinLen + argsLen + envLen;
  if (total > P.JOB_DATA_END - P.JOB_DATA) throw new Error(`request data of ${total} bytes overflows the request area`);
  let at = P.JOB_DATA;
  const take = (n) => {
    const bytes = box.subarray(at, at + n);
    at += n;
    return bytes;
  };
  const code = Buffer.from(take(codeLen)).toString('utf8');
  const stdin = Buffer.from(take(stdinLen));
  const args = strings(take(argsLen));
  const env = strings(take(envLen));
  return {
    language: lang,
    sequence: u32(P.JOB_SEQUENCE),
    mode: u32(P.JOB_MODE),
    flags: u32(P.JOB_FLAGS),
    namespace: u32(P.JOB_NAMESPACE),
    dialect: u32(P.JOB_DIALECT),
    seed: Buffer.from(box.subarray(P.JOB_SEED, P.JOB_SEED + P.JOB_SEED_LEN)),
    code,
    stdin,
    args,
    env,
  };
}

function strings(bytes) {
  const out = [];
  let start = 0;
  for (let i = 0; i < bytes.length; i++) {
    if (bytes[i] === 0) {
      out.push(Buffer.from(bytes.subarray(start, i)).toString('utf8'));
      start = i + 1;
    }
  }
  return out;
}

// ---- per-clone identity

// xoshiro128** over the job's seed: Math.random of every clone differs (V8's own generator
// was seeded once, at the template's boot, and is the same in every clone).
function seededRandom(seed, salt = 0) {
  const s = new Uint32Array(4);
  for (let i = 0; i < 4; i++) {
    s[i] = seed.readUInt32LE(i * 4) ^ seed.readUInt32LE(16 + i * 4) ^ Math.imul(salt + i, 0x9e3779b9);
  }
  if ((s[0] | s[1] | s[2] | s[3]) === 0) s[0] = 1;
  const rotl = (x, k) => (x << k) | (x >>> (32 - k));
  const next = () => {
    const result = Math.imul(rotl(Math.imul(s[1], 5), 7), 9) >>> 0;
    const t = s[1] << 9;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 11);
    return result;
  };
  return function random() {
    // 53 random bits, as V8's own Math.random gives.
    return ((next() >>> 5) * 67108864 + (next() >>> 6)) / 9007199254740992;
  };
}

// The seed of the clone's identity, for contexts made later (each its own stream).
let identitySeed = null;

// Every `vm` context has its own Math (seeded by V8 when it is made, from a generator that
// is the same in every clone): each gets a stream of its own from the clone's seed.
function seedContext(context, namespace) {
  if (identitySeed !== null) mathOf(context).random = seededRandom(identitySeed, namespace + 1);
}

// Each context's Math, found once (a script run in the context: ~1 ms in the guest).
const maths = new WeakMap();
function mathOf(context) {
  let math = maths.get(context);
  if (math === undefined) {
    math = vm.runInContext('Math', context);
    maths.set(context, math);
  }
  return math;
}

function applyIdentity(request) {
  identitySeed = request.seed;
  Math.random = seededRandom(request.seed);
  addon.reseed(request.seed);
  for (const [namespace, context] of contexts) seedContext(context, namespace);
}

// ---- running a job

let current = null; // { sequence, finished }
// The guest's own phases of the request (result::PHASE_*_NS): nanoseconds of the monotonic
// clock from the resume to the end of reading the request, giving the clone its identity,
// compiling the code, and finishing (what `timings.guest` shows).
const marks = { resumed: 0n, read: 0n, identity: 0n, compiled: 0n };
let warming = false; // before READY: a finished warm-up job serves nothing

// The CommonJS names code gets as `node -e` gives them (`[eval]` for a job, `[cell]` for a
// cell's context): a module of that name in the working directory, its `exports`, a
// `require` that resolves from there, `__filename` and `__dirname`.
function moduleBindings(name) {
  const filename = path.join(process.cwd(), name);
  const module = new Module(filename, null);
  module.filename = filename;
  module.paths = Module._nodeModulePaths(process.cwd());
  return {
    module,
    exports: module.exports,
    require: Module.createRequire(filename),
    __filename: name,
    __dirname: '.',
  };
}

function runJob(request) {
  current = { sequence: request.sequence, finished: false };
  process.exitCode = undefined;
  process.argv = [process.execPath, ...request.args];
  for (const entry of request.env) {
    const eq = entry.indexOf('=');
    if (eq > 0) process.env[entry.slice(0, eq)] = entry.slice(eq + 1);
  }
  if (request.stdin.length > 0) {
    // fd 0 is this process's own stdin file, at offset 0 in every clone: a positional write
    // leaves the offset there, so the job reads what it was given.
    realWriteSync.call(fs, 0, request.stdin, 0, request.stdin.length, 0);
  }
  Object.assign(globalThis, moduleBindings('[eval]'));
  const code = request.dialect ? inJavaScript(request.dialect, request.code, '[eval]', true) : request.code;
  const script = new vm.Script(code, { filename: '[eval]' });
  marks.compiled = process.hrtime.bigint();
  script.runInThisContext({ displayErrors: true, breakOnSigint: true });
}

function finish(code, display) {
  if (current === null || current.finished) return;
  current.finished = true;
  if (current.restoreEnv) current.restoreEnv();
  collectFdOutput();
  writeDisplay(display);
  setU32(P.RESULT_OUTCOME, EXITED);
  dv.setInt32(P.RESULT_EXIT_CODE, code | 0, true);
  writePhases();
  if (warming) return;
  const done = current.sequence;
  ring(P.DONE, 0, 0);
  // Resumed: a session's next request (a one-shot job's VM is reset instead).
  serve(done);
}

// An uncaught error as node prints it (util.inspect: the stack and own properties), without
// the kernel's own frames.
function reportUncaught(error) {
  let text;
  try {
    // isNativeError: an error made in a cell's context is no `instanceof Error` here.
    const isError = util.types.isNativeError(error) || error instanceof Error;
    if (isError && error.code === INTERRUPTED) {
      // Where the interrupt found the code is node's and bud's frames, not the user's.
      text = `${error.name}: ${error.message}`;
    } else {
      text = isError ? util.inspect(error) : `Uncaught ${util.inspect(error)}`;
    }
  } catch {
    text = String(error);
  }
  // Without the kernel's own frames; one that opened the error's own properties (` {`)
  // leaves its brace on the line before.
  const lines = [];
  for (const line of text.split('\n')) {
    if (!line.includes(__filename)) lines.push(line);
    else if (line.endsWith(' {') && lines.length > 0) lines[lines.length - 1] += ' {';
  }
  text = lines.join('\n');
  emit(1, Buffer.from(`${text}\n\nNode.js ${process.version}\n`));
}

function exitCodeOf(code) {
  if (code === undefined || code === null) return process.exitCode === undefined ? 0 : Number(process.exitCode) | 0;
  return Number(code) | 0;
}

const EXITED_SENTINEL = Object.freeze({ exited: true });

// The kernel's own failures (outside a job): on its real stderr (the worker shows it), and
// the process ends.
const realReallyExit = process.reallyExit.bind(process);
function kernelFailed(error) {
  realWriteSync.call(fs, 2, `bud-kernel: ${util.inspect(error)}\n`);
  realReallyExit(70);
}

process.exit = function exit(code) {
  if (code !== undefined) process.exitCode = code;
  process.emit('exit', exitCodeOf(code));
  finish(exitCodeOf(code));
  // Only a session's next request gets here, after it ran: stop the exited job's code (the
  // sentinel is not reported as an error of the next one).
  throw EXITED_SENTINEL;
};
process.reallyExit = process.exit;

process.on('uncaughtException', (error) => {
  if (error === EXITED_SENTINEL) return;
  if (current === null) kernelFailed(error);
  if (current.finished) return;
  reportUncaught(error);
  process.exitCode = 1;
  process.emit('exit', 1);
  finish(1);
});

// The host's interrupt of the running request (module docs): only for the request it was
// sent for (the host names it in JOB_INTERRUPT; a late signal stops nothing).
const INTERRUPTED = 'ERR_SCRIPT_EXECUTION_INTERRUPTED';
function interrupted() {
  // As node's own (a loop stopped by breakOnSigint) says it.
  const error = new Error('Script execution was interrupted by `SIGINT`');
  error.code = INTERRUPTED;
  return error;
}
process.on('SIGUSR2', () => {
  if (current === null || current.finished || u32(P.JOB_INTERRUPT) !== current.sequence) return;
  if (current.fail) {
    current.fail(interrupted());
  } else {
    reportUncaught(interrupted());
    finish(EXIT_INTERRUPTED);
  }
});
// A job's exit code when interrupted: a shell's for a process ended by SIGINT.
const EXIT_INTERRUPTED = 130;

// Whether the kernel is inside a beforeExit handler: a request run from there must leave
// the loop something to do (`keepLoop`), or node ends when the handler returns.
let inBeforeExit = false;

process.on('beforeExit', () => {
  if (current === null || current.finished) return;
  inBeforeExit = true;
  try {
    // A cell ends when its code settles; one whose promise can no longer settle (nothing
    // left to run) ends here, without a value.
    if (current.cell) {
      finish(0);
      return;
    }
    const code = exitCodeOf(undefined);
    process.emit('exit', code);
    finish(code);
  } finally {
    inBeforeExit = false;
  }
});

// The loop turns once more, so that beforeExit comes again for a request that schedules
// nothing; not needed (one poll of the loop saved) for a clone's first request, which runs
// before the loop has started or from a callback of it.
function keepLoop() {
  if (inBeforeExit) setImmediate(noop);
}

function writePhases() {
  const since = (at) => (at === 0n || marks.resumed === 0n ? 0n : at - marks.resumed);
  const finished = process.hrtime.bigint();
  dv.setBigUint64(P.RESULT_PHASE_READ_NS, since(marks.read), true);
  dv.setBigUint64(P.RESULT_PHASE_IDENTITY_NS, since(marks.identity), true);
  dv.setBigUint64(P.RESULT_PHASE_COMPILED_NS, since(marks.compiled), true);
  dv.setBigUint64(P.RESULT_PHASE_FINISHED_NS, since(finished), true);
  setU32(P.RESULT_GUEST_FLAGS, 0);
  marks.read = marks.identity = marks.compiled = 0n;
}

// ---- dialects

// What each dialect a template may name is turned into JavaScript by.
const TRANSLATORS = { typescript: stripTypes };
// The template's dialects, in wire order (main() checks each has a translator).
const DIALECTS = JSON.parse(process.env.BUD_DIALECTS || '[]');
delete process.env.BUD_DIALECTS;

// `code` of dialect number `dialect` as JavaScript; a job's (`job`) as a CommonJS script
// (its `import`s made `require`s), a cell's with its `import`s kept for cellSource. A
// syntax error of the dialect is thrown as a SyntaxError that says where, as V8's do.
function inJavaScript(dialect, code, filename, job) {
  const name = DIALECTS[dialect - 1];
  if (name === undefined) throw new Error(`this kernel runs no dialect number ${dialect}`);
  try {
    return TRANSLATORS[name](code, job);
  } catch (error) {
    if (!error || !error.loc) throw error;
    const line = code.split('\n')[error.loc.line - 1] || '';
    const caret = `${' '.repeat(Math.max(0, error.loc.column - 1))}^`;
    const syntax = new SyntaxError(error.message);
    const at = `${filename}:${error.loc.line}:${error.loc.column}`;
    syntax.stack = `${filename}:${error.loc.line}\n${line}\n${caret}\n\nSyntaxError: ${error.message}\n    at ${at}`;
    throw syntax;
  }
}

// sucrase (an npm package of the template, loaded in the warm-up): a TypeScript parser that
// drops the types and keeps every line where it was. A cell keeps its imports, even those it
// does not use itself (a later cell may); enums and parameter properties become JavaScript.
let sucrase = null;
const SUCRASE = process.env.BUD_SUCRASE || 'sucrase';
delete process.env.BUD_SUCRASE;
function stripTypes(code, job) {
  sucrase = sucrase || require(SUCRASE);
  const transforms = job ? ['typescript', 'imports'] : ['typescript'];
  return sucrase.transform(code, { transforms, disableESTransforms: true, keepUnusedImports: !job }).code;
}

// ---- session cells

// A session's JavaScript contexts, by namespace number (0: the session's own; another: a
// code-interpreter client's context, made on first use). Each is a `vm` context whose global
// object has Node's globals (timers, `process`, `Buffer`, `require` relative to the working
// directory...), so that contexts do not see each other's variables.
const contexts = new Map();
// Node's globals a context gets, copied as property descriptors (the lazy `fetch` and
// `crypto` stay lazy).
const CONTEXT_GLOBALS = [
  'process', 'console', 'Buffer', 'global', 'setTimeout', 'setInterval', 'setImmediate',
  'clearTimeout', 'clearInterval', 'clearImmediate', 'queueMicrotask', 'structuredClone',
  'atob', 'btoa', 'performance', 'fetch', 'crypto', 'URL', 'URLSearchParams', 'TextEncoder',
  'TextDecoder', 'AbortController', 'AbortSignal', 'Event', 'EventTarget', 'MessageChannel',
  'MessagePort', 'MessageEvent', 'BroadcastChannel', 'Blob', 'Headers', 'Request', 'Response',
  'FormData', 'DOMException', 'WebAssembly',
];

function newContext() {
  const sandbox = {};
  for (const name of CONTEXT_GLOBALS) {
    const descriptor = Object.getOwnPropertyDescriptor(globalThis, name);
    if (descriptor) Object.defineProperty(sandbox, name, descriptor);
  }
  Object.assign(sandbox, moduleBindings('[cell]'));
  const context = vm.createContext(sandbox, { name: 'bud cell context' });
  sandbox.global = vm.runInContext('globalThis', context);
  return context;
}

// acorn (Debian's node-acorn, which node's own REPL uses too) parses a cell so that it can
// run as the body of an async function (top-level `await`) while its declarations stay in
// the context for the next cells.
let acorn = null;
// Where it is (another place in host tests, which use the host's node).
const ACORN = process.env.BUD_ACORN || '/usr/share/nodejs/acorn/dist/acorn.js';
delete process.env.BUD_ACORN;

// A cell as [a prelude script declaring its top-level names with `var`, an async function
// expression running it]: `const x = 1` becomes `void (x = 1)`, `function f(){}` and
// `class C {}` assignments (functions first, as they are hoisted), and a last expression
// statement becomes the function's return value (the cell's value). Re-running a cell that
// declares `const x` is then no error, as in node's REPL.
function cellSource(code) {
  acorn = acorn || require(ACORN);
  const ast = acorn.parse(code, {
    ecmaVersion: 'latest',
    sourceType: 'script',
    allowAwaitOutsideFunction: true,
    allowImportExportEverywhere: true,
    allowHashBang: true,
  });
  const names = [];
  const hoisted = [];
  const edits = [];
  const text = (node) => code.slice(node.start, node.end);
  // `node` (a statement, or the declaration of an `export`) in place of `[start, end)`.
  const declare = (node, start, end, last) => {
    if (node.type === 'VariableDeclaration') {
      const parts = node.declarations.map((d) => {
        patternNames(d.id, names);
        return `(${text(d.id)} = ${d.init ? text(d.init) : 'undefined'})`;
      });
      edits.push([start, end, `void (${parts.join(', ')});`]);
    } else if (node.type === 'FunctionDeclaration') {
      names.push(node.id.name);
      hoisted.push(`${node.id.name} = ${text(node)};`);
      edits.push([start, end, '']);
    } else if (node.type === 'ClassDeclaration') {
      names.push(node.id.name);
      edits.push([start, end, `${node.id.name} = ${text(node)};`]);
    } else if (node.type === 'ImportDeclaration') {
      edits.push([start, end, importSource(node, names, text)]);
    } else if (last && node.type === 'ExpressionStatement') {
      edits.push([start, end, `return (${text(node.expression)});`]);
    } else if (start !== node.start) {
      edits.push([start, end, `${text(node)};`]);
    }
  };
  ast.body.forEach((node, i) => {
    const last = i === ast.body.length - 1;
    if (node.type === 'ExportNamedDeclaration') {
      // A cell is no module: what it exports is declared in its context, the rest dropped.
      if (node.declaration) declare(node.declaration, node.start, node.end, false);
      else edits.push([node.start, node.end, '']);
    } else if (node.type === 'ExportDefaultDeclaration' || node.type === 'ExportAllDeclaration') {
      edits.push([node.start, node.end, node.declaration ? `void (${text(node.declaration)});` : '']);
    } else {
      declare(node, node.start, node.end, last);
    }
  });
  let body = '';
  let at = 0;
  for (const [start, end, replacement] of edits) {
    body += code.slice(at, start) + replacement;
    at = end;
  }
  body += code.slice(at);
  const prelude = names.length ? `var ${[...new Set(names)].join(', ')};` : '';
  return [prelude, `(async () => {${hoisted.join(' ')}\n${body}\n})()`];
}

// An `import` of a cell as `require`s into the context's names: the default import is a
// CommonJS module's exports (or an ES module's `default`, as compiled), a namespace import
// the module, a named import its property. A module only `import()` can load (ES-only
// packages) throws ERR_REQUIRE_ESM.
function importSource(node, names, text) {
  const from = `require(${text(node.source)})`;
  if (node.specifiers.length === 0) return `${from};`;
  const sets = node.specifiers.map((s) => {
    names.push(s.local.name);
    if (s.type === 'ImportDefaultSpecifier') return `${s.local.name} = m && m.__esModule ? m.default : m;`;
    if (s.type === 'ImportNamespaceSpecifier') return `${s.local.name} = m;`;
    const imported = s.imported.type === 'Literal' ? JSON.stringify(s.imported.value) : JSON.stringify(s.imported.name);
    return `${s.local.name} = m[${imported}];`;
  });
  return `void ((m) => { ${sets.join(' ')} })(${from});`;
}

function patternNames(pattern, names) {
  switch (pattern.type) {
    case 'Identifier':
      names.push(pattern.name);
      break;
    case 'ObjectPattern':
      for (const p of pattern.properties) patternNames(p.type === 'RestElement' ? p.argument : p.value, names);
      break;
    case 'ArrayPattern':
      for (const e of pattern.elements) if (e) patternNames(e, names);
      break;
    case 'RestElement':
      patternNames(pattern.argument, names);
      break;
    case 'AssignmentPattern':
      patternNames(pattern.left, names);
      break;
    default:
      break;
  }
}

function runCell(request) {
  current = { sequence: request.sequence, finished: false, cell: true, restoreEnv: null };
  if (request.flags & P.JOB_FLAGS_RESEED) applyIdentity(request);
  const args = [...request.args];
  const start = request.flags & P.JOB_FLAGS_START_DIRECTORY ? args.shift() : undefined;
  if (request.flags & P.JOB_FLAGS_RESET_NAMESPACE) contexts.delete(request.namespace);
  let context = contexts.get(request.namespace);
  if (context === undefined) {
    if (start !== undefined) {
      try {
        process.chdir(start);
      } catch {
        // as for Python contexts: a directory it cannot enter leaves it where it is
      }
    }
    context = newContext();
    seedContext(context, request.namespace);
    contexts.set(request.namespace, context);
  }
  current.restoreEnv = setCellEnv(request.env);
  const inDisplay = (request.flags & P.JOB_FLAGS_ERROR_IN_DISPLAY) !== 0;
  const failed = (current.fail = (error) => {
    if (error === EXITED_SENTINEL) return;
    if (inDisplay) {
      finish(1, { error: errorOf(error) });
    } else {
      reportUncaught(error);
      finish(1);
    }
  });
  let promise;
  try {
    const code = request.dialect ? inJavaScript(request.dialect, request.code, '[cell]', false) : request.code;
    let source;
    try {
      source = cellSource(code);
    } catch {
      // Not JavaScript acorn reads: V8's own SyntaxError says where, as for a job.
      new vm.Script(code, { filename: '[cell]' });
      throw new SyntaxError('the cell could not be parsed');
    }
    if (source[0]) vm.runInContext(source[0], context);
    // lineOffset: the cell's own first line is line 1 in stacks (the wrapper's is 0).
    promise = vm.runInContext(source[1], context, { filename: '[cell]', lineOffset: -1, breakOnSigint: true });
  } catch (error) {
    failed(error);
    return;
  }
  promise.then((value) => {
    if (current === null || current.finished || current.sequence !== request.sequence) return;
    finish(0, value === undefined ? undefined : { value: [{ type: 'text/plain', data: inspectValue(value) }] });
  }, (error) => {
    if (current === null || current.finished || current.sequence !== request.sequence) return;
    failed(error);
  });
  keepLoop();
}

function inspectValue(value) {
  try {
    return util.inspect(value);
  } catch (error) {
    return `<inspect failed: ${error}>`;
  }
}

// Jupyter's error: name, message, and the stack as text (without the kernel's frames).
function errorOf(error) {
  if (!util.types.isNativeError(error) && !(error instanceof Error)) {
    return { name: 'Error', value: inspectValue(error), traceback: `Uncaught ${inspectValue(error)}` };
  }
  const stack = String(error.stack || `${error.name}: ${error.message}`)
    .split('\n')
    .filter((line) => !line.includes(__filename))
    .join('\n');
  return { name: String(error.name), value: String(error.message), traceback: stack };
}

// A cell's env for its run only (as the Python worker's cells): returns the undo.
function setCellEnv(entries) {
  if (entries.length === 0) return null;
  const saved = [];
  for (const entry of entries) {
    const eq = entry.indexOf('=');
    if (eq <= 0) continue;
    const name = entry.slice(0, eq);
    saved.push([name, Object.prototype.hasOwnProperty.call(process.env, name) ? process.env[name] : undefined]);
    process.env[name] = entry.slice(eq + 1);
  }
  return () => {
    for (const [name, value] of saved.reverse()) {
      if (value === undefined) delete process.env[name];
      else process.env[name] = value;
    }
  };
}

// The display JSON at the request area (its length at RESULT_DISPLAY_LEN), as the Python
// worker writes it (bud_session.display_json); 0 when there is none.
function writeDisplay(display) {
  if (display === undefined) {
    setU32(P.RESULT_DISPLAY_LEN, 0);
    return;
  }
  const room = P.JOB_DATA_END - P.JOB_DATA;
  let bytes = Buffer.from(JSON.stringify({ value: display.value || [], figures: [], ...(display.error ? { error: display.error } : {}) }));
  if (bytes.length > room) {
    const cut = { value: [], figures: [] };
    if (display.error) cut.error = { ...display.error, traceback: display.error.traceback.slice(-room / 2) };
    bytes = Buffer.from(JSON.stringify(cut));
  }
  box.set(bytes, P.JOB_DATA);
  setU32(P.RESULT_DISPLAY_LEN, bytes.length);
}

// ---- the doorbell and the hand-off

function noop() {}

// Whether the next request gives this clone its identity whatever its flags (the worker
// served the clone's or fork's first request, with its RESEED).
let reseedNext = false;

function handToWorker() {
  realWriteSync.call(fs, TOKEN_OUT, Buffer.from([TOKEN_TO_WORKER]));
  const buf = Buffer.alloc(1);
  for (;;) {
    try {
      if (fs.readSync(TOKEN_IN, buf, 0, 1, null) === 1) {
        if (buf[0] === TOKEN_RESEED) reseedNext = true;
        return;
      }
    } catch (error) {
      if (error.code !== 'EINTR' && error.code !== 'EAGAIN') throw error;
    }
  }
}

// Runs the requests the host gives, one per resume. `done`: the sequence number of the last
// request this kernel answered (a resume with it again rings DONE again).
function serve(done) {
  for (;;) {
    marks.resumed = process.hrtime.bigint();
    const request = readRequest();
    marks.read = process.hrtime.bigint();
    if (request.language !== P.LANGUAGE_KERNEL) {
      handToWorker();
      continue;
    }
    if (request.sequence === done) {
      ring(P.DONE, 0, 0);
      continue;
    }
    if (reseedNext) {
      reseedNext = false;
      applyIdentity(request);
    }
    if (request.mode === P.MODE_CELL) {
      runCell(request);
      return;
    }
    try {
      applyIdentity(request);
      marks.identity = process.hrtime.bigint();
      runJob(request);
    } catch (error) {
      if (error === EXITED_SENTINEL) throw error; // an earlier job's process.exit, unwinding
      reportUncaught(error);
      finish(error && error.code === INTERRUPTED ? EXIT_INTERRUPTED : 1);
    }
    // To the event loop; beforeExit finishes the job.
    keepLoop();
    return;
  }
}

// ---- before READY

// Jobs run before READY through the same path as real ones, with the output dropped, so
// that clones find the code they need compiled: printing, errors with stacks, require,
// promises and timers, process.exit.
// Each runs inside a function, so its declarations stay in it: a script's top-level `const`
// or `function` would stay in the global scope of the snapshot (and a job's own `const fs`
// or `let f` would then be a SyntaxError); the global object's own names are checked after.
const WARM_JOBS = [
  'console.log(1 + 1); console.error("e"); console.log({ a: [1, "x"] })',
  'const fs = require("fs"); const os = require("os"); const p = require("path"); ' +
    'process.stdout.write(p.join("a", "b") + os.EOL + String(fs.existsSync("/")))',
  'function f() { null.x; } try { f(); } catch (e) { console.log(e.stack); }',
  'Promise.resolve(1).then((v) => setTimeout(() => console.log(v), 0))',
  'const c = require("crypto"); console.log(c.createHash("sha256").update("x").digest("hex"))',
  'JSON.parse(JSON.stringify({ a: 1 })); [3, 1, 2].sort().map((x) => x * 2).join()',
  'throw new TypeError("warm")',
  'process.exitCode = 3',
];

// Cells run before READY too (in namespace 0, which then starts empty again).
const WARM_CELLS = [
  'const a = [1, 2, 3]; let b = a.map((x) => x * 2); function f() { return b; } f()',
  'await new Promise((r) => setTimeout(r, 1)); ({ a, b })',
  'null.x',
];

// Each dialect's own job and cell before READY (its translator loaded and compiled).
const WARM_DIALECT = {
  typescript: {
    job: 'interface P { x: number } enum E { A, B } const p: P = { x: E.B }; console.log(p.x as number)',
    cell: 'import * as os from "os"; type T = string[]; const t: T = [os.EOL]; t.length',
  },
};

// The warm-up's jobs and cells, with the dialect each is written in.
function warmRequests() {
  const jobs = WARM_JOBS.map((code) => ({ code, dialect: 0 }));
  const cells = WARM_CELLS.map((code) => ({ code, dialect: 0 }));
  DIALECTS.forEach((name, i) => {
    jobs.push({ code: WARM_DIALECT[name].job, dialect: i + 1 });
    cells.unshift({ code: WARM_DIALECT[name].cell, dialect: i + 1 });
  });
  return { jobs, cells };
}

// A request as the host writes it (vmm/src/job/run.rs), into the scratch mailbox of the
// warm-up.
function writeWarmRequest(request) {
  const parts = [
    Buffer.from(request.code),
    Buffer.from(request.stdin),
    Buffer.from(request.args.map((a) => `${a}\0`).join('')),
    Buffer.from(request.env.map((e) => `${e}\0`).join('')),
  ];
  setU32(P.JOB_LANGUAGE, P.LANGUAGE_KERNEL);
  setU32(P.JOB_CODE_LEN, parts[0].length);
  setU32(P.JOB_STDIN_LEN, parts[1].length);
  setU32(P.JOB_ARGC, request.args.length);
  setU32(P.JOB_ARGS_LEN, parts[2].length);
  setU32(P.JOB_ENVC, request.env.length);
  setU32(P.JOB_ENV_LEN, parts[3].length);
  setU32(P.JOB_SEQUENCE, request.sequence);
  setU32(P.JOB_MODE, request.mode);
  setU32(P.JOB_FLAGS, request.flags);
  setU32(P.JOB_NAMESPACE, 0);
  setU32(P.JOB_DIALECT, 0);
  box.set(request.seed, P.JOB_SEED);
  let at = P.JOB_DATA;
  for (const part of parts) {
    box.set(part, at);
    at += part.length;
  }
}

// The request path itself, before READY: reading a request, the phases, the display, the
// end of a job (V8 compiles a function when it is first called: done here, in the template,
// not in every clone). A job's and a cell's, a few times each.
function warmRequestPath(seed) {
  for (let round = 0; round < 3; round++) {
    for (const mode of [P.MODE_JOB, P.MODE_CELL]) {
      const sequence = 1000 + round * 2 + mode;
      writeWarmRequest({ code: '1 + 1', stdin: 'in', args: ['a'], env: ['BUD_WARM=1'], sequence, mode, flags: P.JOB_FLAGS_RESEED, seed });
      serve(null);
      finish(0, { value: [{ type: 'text/plain', data: '2' }] });
    }
  }
  process.exitCode = undefined;
  process.argv = [process.execPath];
}

function warmUp() {
  const scratch = new Uint8Array(P.MAILBOX_DEFAULT_SIZE);
  const realBox = box;
  const realDv = dv;
  box = scratch;
  dv = new DataView(scratch.buffer);
  const realRing = ring;
  ring = (code) => {
    setU32(P.RESULT_STDOUT_LEN, 0);
    setU32(P.RESULT_STDERR_LEN, 0);
    return code;
  };
  const seed = Buffer.alloc(P.JOB_SEED_LEN, 7);
  const { jobs, cells } = warmRequests();
  let index = 0;
  warming = true;
  return new Promise((resolve) => {
    const next = () => {
      if (index >= jobs.length && index < jobs.length + cells.length) {
        const { code, dialect } = cells[index - jobs.length];
        index += 1;
        const flags = index === jobs.length + cells.length ? P.JOB_FLAGS_ERROR_IN_DISPLAY : 0;
        runCell({ sequence: index, code, dialect, args: [], env: ['BUD_WARM=1'], stdin: Buffer.alloc(0), flags, namespace: 0, seed });
        setTimeout(next, 20);
        return;
      }
      if (index === jobs.length + cells.length) {
        warmRequestPath(seed);
        // Namespace 0 starts empty in every session, and made: its first cell pays no
        // context creation.
        contexts.clear();
        const first = newContext();
        mathOf(first);
        contexts.set(0, first);
        identitySeed = null;
        box = realBox;
        dv = realDv;
        ring = realRing;
        current = null;
        warming = false;
        resolve();
        return;
      }
      const { code: body, dialect } = jobs[index++];
      const code = `(function () {\n${body}\n})();`;
      current = { sequence: index, finished: false };
      try {
        applyIdentity({ seed });
        runJob({ sequence: index, code, dialect, args: ['a'], env: ['BUD_WARM=1'], stdin: Buffer.alloc(0) });
      } catch (error) {
        reportUncaught(error);
      }
      setTimeout(next, 5);
    };
    next();
  });
}

function main() {
  // Started for good (module docs); it outlives the warm-up in every clone.
  process.binding('contextify').startSigintWatchdog();
  for (const name of DIALECTS) {
    if (!TRANSLATORS[name]) {
      kernelFailed(new Error(`the template names dialect ${JSON.stringify(name)}; this kernel runs ${Object.keys(TRANSLATORS).join(', ')}`));
    }
  }
  const mailbox = addon.mapMailbox(MAILBOX_FD, P.MAILBOX_DEFAULT_SIZE);
  box = new Uint8Array(mailbox);
  dv = new DataView(mailbox);
  const started = Date.now();
  const globalsBefore = new Set(Object.getOwnPropertyNames(globalThis));
  warmUp().then(() => {
    // Restore the process's own state the warm-up jobs changed.
    process.exitCode = undefined;
    delete process.env.BUD_WARM;
    for (const name of Object.getOwnPropertyNames(globalThis)) {
      if (!globalsBefore.has(name) && !delete globalThis[name]) {
        kernelFailed(new Error(`the warm-up left the global ${name} behind`));
      }
    }
    realWriteSync.call(fs, TOKEN_OUT, Buffer.from(`W${Date.now() - started}\n`));
    // Wait for the worker's word to ring READY (it settles the guest first).
    // (`R`, when JavaScript is the template's default runtime), or the first request for
    // it (`K`, when the worker rang READY).
    const buf = Buffer.alloc(1);
    while (fs.readSync(TOKEN_IN, buf, 0, 1, null) !== 1);
    addon.takeDoorbell();
    if (buf[0] === TOKEN_RESEED) reseedNext = true;
    if (buf[0] === TOKEN_READY) {
      // Every page mapped now present in the template (as the Python worker does): a job
      // that touched a page for the first time would take a guest page fault (emulated
      // under kvm_pvm) and change a template page table, which makes the VM's reset drop
      // every shadow mapping (vmm/src/reset.rs): ~1 700 faults in the next job.
      addon.lockMemory();
      // Right after a tick: every clone's job then has a whole tick period before the next.
      addon.afterTick();
      const wallNs = BigInt(Math.round((performance.timeOrigin + performance.now()) * 1000)) * 1000n;
      dv.setBigUint64(P.HEADER_READY_WALL_NS, wallNs, true);
      ring(P.READY, BigInt(addon.mailboxAddress()), BigInt(P.MAILBOX_DEFAULT_SIZE));
      // A clone resumes here.
    }
    serve(null);
  });
}

main();
