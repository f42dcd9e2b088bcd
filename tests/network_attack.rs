//! The stalled-dial attack of issue 58 on real guests. Attacker sandboxes (more of them than
//! it takes to hold every dial thread of the old blocking pool: 3 x 2) each open
//! [`SOCKETS`] non-blocking connections to a loopback port whose listener never completes a
//! handshake (backlog 0 and one connection never accepted: Linux drops every further SYN),
//! and open a new one for each that fails, while a victim sandbox resolves an allowed name
//! and connects to a loopback echo server. The victim's lookup and connection succeed; each
//! attacker's connections past its cap of dials in flight were refused by the stack (its
//! egress is told: `Limit::Dials`). Timings are printed, never asserted; the ignored test
//! measures the victim with and without the attack (`scripts/bench-dial-attack.sh`).
//! Traffic goes only to the test's own listeners on 127.0.0.1. Needs /dev/kvm.

mod common;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmm::{
    ConnectRequest, Egress, Executor, ExecutorOptions, Job, JobEgress, JobResult, Limit, Status,
    Verdict,
};

/// The name the victim may resolve and connect to (the echo server).
const ECHO_NAME: &str = "echo.test";
/// The name the attackers resolve (the hanging port).
const HANG_NAME: &str = "hang.test";
/// A name the attackers' egress knows once the test wants them to stop.
const STOP_NAME: &str = "stop.test";
/// Attacker sandboxes.
const ATTACKERS: usize = 3;
/// Connections each attacker keeps being dialed: past the stack's cap of 32 in flight.
const SOCKETS: usize = 40;
/// How long the test waits for the attack to be under way, or for a job.
const PATIENCE: Duration = Duration::from_secs(300);

/// Maps [`ECHO_NAME`] to the echo server; refuses everything else. Keeps when it was first
/// asked about a connection.
#[derive(Debug)]
struct EchoOnly {
    echo: SocketAddr,
    asked: std::sync::Mutex<Option<Instant>>,
}

impl Egress for EchoOnly {
    fn knows(&self, name: &str) -> bool {
        name == ECHO_NAME
    }

    fn connect(&self, req: &ConnectRequest<'_>) -> Verdict {
        self.asked.lock().unwrap().get_or_insert_with(Instant::now);
        match req.name {
            Some(ECHO_NAME) => Verdict::Dial(self.echo),
            _ => Verdict::Refuse,
        }
    }
}

/// An attacker's egress: [`HANG_NAME`] resolves and every connection is dialed to the
/// hanging port; [`STOP_NAME`] resolves once `stop` is set. Counts the dials and the
/// connections the stack refused for too many dials in flight.
#[derive(Debug)]
struct Attacker {
    hanging: SocketAddr,
    stop: Arc<AtomicBool>,
    dials: AtomicUsize,
    capped: AtomicUsize,
}

impl Egress for Attacker {
    fn knows(&self, name: &str) -> bool {
        name == HANG_NAME || (name == STOP_NAME && self.stop.load(Ordering::SeqCst))
    }

    fn connect(&self, _: &ConnectRequest<'_>) -> Verdict {
        self.dials.fetch_add(1, Ordering::SeqCst);
        Verdict::Dial(self.hanging)
    }

    fn over_limit(&self, _: &ConnectRequest<'_>, limit: Limit) {
        if limit == Limit::Dials {
            self.capped.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// A listener on 127.0.0.1 whose accept queue is full (backlog 0, one connection never
/// accepted): every further connect to it hangs. Both are returned, to keep them open.
fn hanging_listener() -> (TcpListener, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    // SAFETY: listen takes no pointers; `listener` is a bound socket that stays open.
    // Listening again only changes the backlog.
    let rc = unsafe { libc::listen(listener.as_raw_fd(), 0) };
    assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
    let filler = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    (listener, filler)
}

fn executor() -> Executor {
    let opts = ExecutorOptions {
        pool_size: 0,
        ..ExecutorOptions::default()
    };
    Executor::new(common::network_template(), opts).expect("starting the executor failed")
}

fn job(code: String, egress: Arc<dyn Egress>) -> Job {
    let mut j = Job::python(code);
    // Every socket call is emulated guest-kernel work on kvm_pvm.
    j.timeout = PATIENCE;
    j.egress = Some(JobEgress(egress));
    j
}

/// The attack under way: each attacker's egress and the thread running its job.
struct Attack {
    stop: Arc<AtomicBool>,
    attackers: Vec<(Arc<Attacker>, Running)>,
}

/// The thread running an attacker's job: it returns the job's result and the seconds its
/// vCPU was on a core.
type Running = JoinHandle<(JobResult, f64)>;

impl Attack {
    /// Starts [`ATTACKERS`] sandboxes dialing `hanging` and returns once each has had
    /// connections refused for too many dials in flight (so each holds its cap).
    fn start(hanging: SocketAddr) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let code = format!(
            "import socket, select, time\n\
             addr = socket.gethostbyname({HANG_NAME:?})\n\
             def dial():\n\
             \x20   s = socket.socket()\n\
             \x20   s.setblocking(False)\n\
             \x20   s.connect_ex((addr, {port}))\n\
             \x20   return s\n\
             socks = [dial() for _ in range({SOCKETS})]\n\
             redials = 0\n\
             while True:\n\
             \x20   try:\n\
             \x20       socket.gethostbyname({STOP_NAME:?})\n\
             \x20       break\n\
             \x20   except socket.gaierror:\n\
             \x20       pass\n\
             \x20   time.sleep(3)\n\
             \x20   _, done, _ = select.select([], socks, [], 0)\n\
             \x20   for s in done:\n\
             \x20       socks.remove(s)\n\
             \x20       s.close()\n\
             \x20       socks.append(dial())\n\
             \x20       redials += 1\n\
             print('stopped', redials)\n",
            port = hanging.port()
        );
        let attackers = (0..ATTACKERS)
            .map(|_| {
                let egress = Arc::new(Attacker {
                    hanging,
                    stop: stop.clone(),
                    dials: AtomicUsize::new(0),
                    capped: AtomicUsize::new(0),
                });
                let j = job(code.clone(), egress.clone());
                let run = std::thread::spawn(move || {
                    let exec = executor();
                    let before = schedstat().0;
                    let r = exec.run(&j).expect("running an attacker failed");
                    (r, schedstat().0 - before)
                });
                (egress, run)
            })
            .collect::<Vec<_>>();
        let started = Instant::now();
        while attackers
            .iter()
            .any(|(a, _)| a.capped.load(Ordering::SeqCst) == 0)
        {
            assert!(
                started.elapsed() < PATIENCE,
                "the attackers never reached their cap"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!(
            "attack under way after {:?}: {} dials in flight in the process",
            started.elapsed(),
            vmm::net::dials_in_flight()
        );
        Self { stop, attackers }
    }

    /// Stops the attackers and returns what each did.
    fn stop(self) -> Vec<Attacked> {
        self.stop.store(true, Ordering::SeqCst);
        self.attackers
            .into_iter()
            .map(|(a, run)| {
                let (result, cpu) = run.join().expect("an attacker's thread panicked");
                Attacked {
                    result,
                    cpu,
                    dials: a.dials.load(Ordering::SeqCst),
                    capped: a.capped.load(Ordering::SeqCst),
                }
            })
            .collect()
    }
}

/// What one attacker did: its job's result, the seconds its vCPU was on a core, its dials
/// and its connections refused past its cap.
struct Attacked {
    result: JobResult,
    cpu: f64,
    dials: usize,
    capped: usize,
}

impl std::fmt::Display for Attacked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} ({}), vCPU on a core {:.1} s, {} dials, {} refused past the cap",
            self.result.status,
            String::from_utf8_lossy(&self.result.stdout).trim(),
            self.cpu,
            self.dials,
            self.capped
        )
    }
}

/// What the victim's job measured in its guest, in seconds: the lookup, the connect's start
/// (the guest's own work up to its SYN sent: `connect` on a non-blocking socket) and its
/// answer (from then until the socket is connected: the host's dial and the guest's
/// receiving the SYN-ACK); and what the host's scheduler counted for its vCPU thread (this
/// thread) over the whole job: seconds on a core, and waiting for one.
#[derive(Debug)]
struct Victim {
    lookup: f64,
    send: f64,
    answer: f64,
    cpu: f64,
    waited: f64,
    /// The whole job, and when in it the host was asked about the connection.
    job: f64,
    asked: f64,
}

/// This thread's time on a core and waiting for one, in seconds (the host's scheduler
/// statistics: the vCPU of a job runs on the thread that runs it).
fn schedstat() -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap();
    let ns: Vec<u64> = stat
        .split_whitespace()
        .map(|f| f.parse().unwrap())
        .collect();
    (ns[0] as f64 / 1e9, ns[1] as f64 / 1e9)
}

/// Runs the victim's job on `exec`: resolve [`ECHO_NAME`], connect, echo a ping.
fn victim(exec: &Executor, echo: SocketAddr) -> Result<Victim, String> {
    let code = format!(
        "import select, socket, time\n\
         t0 = time.monotonic()\n\
         try:\n\
         \x20   ai = socket.getaddrinfo({ECHO_NAME:?}, {port}, socket.AF_INET, socket.SOCK_STREAM)\n\
         \x20   t1 = time.monotonic()\n\
         \x20   s = socket.socket()\n\
         \x20   s.setblocking(False)\n\
         \x20   s.connect_ex(ai[0][4])\n\
         \x20   t2 = time.monotonic()\n\
         \x20   select.select([], [s], [], 60)\n\
         \x20   err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)\n\
         \x20   t3 = time.monotonic()\n\
         \x20   s.setblocking(True)\n\
         \x20   s.sendall(b'ping')\n\
         \x20   got = s.recv(4)\n\
         \x20   s.close()\n\
         \x20   print(got.decode(), err, f'{{t1 - t0:.4f}}', f'{{t2 - t1:.4f}}', f'{{t3 - t2:.4f}}')\n\
         except OSError as e:\n\
         \x20   print('failed', type(e).__name__, e)\n",
        port = echo.port()
    );
    let egress = Arc::new(EchoOnly {
        echo,
        asked: Default::default(),
    });
    let (before, started) = (schedstat(), Instant::now());
    let r = exec
        .run(&job(code, egress.clone()))
        .map_err(|e| e.to_string())?;
    let (after, job_time) = (schedstat(), started.elapsed());
    let asked = egress
        .asked
        .lock()
        .unwrap()
        .map_or(f64::NAN, |t| (t - started).as_secs_f64());
    let out = String::from_utf8_lossy(&r.stdout).into_owned();
    let fields: Vec<&str> = out.split_whitespace().collect();
    match (r.status, fields.as_slice()) {
        (Status::Ok, ["ping", "0", lookup, send, answer]) => Ok(Victim {
            lookup: lookup.parse().map_err(|_| out.clone())?,
            send: send.parse().map_err(|_| out.clone())?,
            answer: answer.parse().map_err(|_| out.clone())?,
            cpu: after.0 - before.0,
            waited: after.1 - before.1,
            job: job_time.as_secs_f64(),
            asked,
        }),
        _ => Err(format!(
            "{:?}: {out} {}",
            r.status,
            String::from_utf8_lossy(&r.stderr)
        )),
    }
}

#[test]
fn a_victims_lookup_and_connection_succeed_while_other_sandboxes_dials_hang() {
    let (hanging, _filler) = hanging_listener();
    let echo = common::echo_server();
    let exec = executor();

    let attack = Attack::start(hanging.local_addr().unwrap());
    let during = victim(&exec, echo);
    let attackers = attack.stop();

    let during = during.expect("the victim's lookup and connection under attack");
    eprintln!("victim under attack: {during:?}");
    for a in &attackers {
        let out = String::from_utf8_lossy(&a.result.stdout);
        let err = String::from_utf8_lossy(&a.result.stderr);
        assert_eq!(a.result.status, Status::Ok, "{out} {err}");
        assert!(out.starts_with("stopped "), "{out}");
        assert!(a.capped > 0, "connections past the cap were refused");
        eprintln!("attacker: {a}");
    }
}

/// The median of `xs` (sorted here).
fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Runs the victim `rounds` times and prints the medians of its lookups and connects.
fn measure(label: &str, exec: &Executor, echo: SocketAddr, rounds: usize) {
    let (mut lookups, mut connects, mut failures) = (Vec::new(), Vec::new(), Vec::new());
    let (mut answers, mut cpu, mut waited) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        match victim(exec, echo) {
            Ok(v) => {
                println!(
                    "  round: lookup {:.3} s, connect {:.3} s (its SYN out {:.3} s, answered \
                     {:.3} s later); job {:.3} s, host asked at {:.3} s; vCPU on a core \
                     {:.3} s, waiting for one {:.3} s",
                    v.lookup,
                    v.send + v.answer,
                    v.send,
                    v.answer,
                    v.job,
                    v.asked,
                    v.cpu,
                    v.waited
                );
                lookups.push(v.lookup);
                connects.push(v.send + v.answer);
                answers.push(v.answer);
                cpu.push(v.cpu);
                waited.push(v.waited);
            }
            Err(e) => failures.push(e),
        }
    }
    let mut both: Vec<f64> = lookups.iter().zip(&connects).map(|(l, c)| l + c).collect();
    let each: Vec<f64> = both.iter().map(|x| (x * 1e4).round() / 10.0).collect();
    println!(
        "{label}: {rounds} rounds, {} failed; median lookup {:.1} ms, connect {:.1} ms, \
         lookup+connect {:.1} ms; each lookup+connect (ms): {each:?}",
        failures.len(),
        median(&mut lookups) * 1e3,
        median(&mut connects) * 1e3,
        median(&mut both) * 1e3,
    );
    println!(
        "  medians: the connect's answer {:.1} ms; the victim's vCPU thread over each job \
         {:.2} s on a core, {:.2} s waiting for one",
        median(&mut answers) * 1e3,
        median(&mut cpu),
        median(&mut waited)
    );
    for f in failures {
        println!("  failure: {f}");
    }
}

/// The victim's lookup and connect, medians of `BUD_ATTACK_ROUNDS` (default 7) jobs without
/// the attack and as many during it (`scripts/bench-dial-attack.sh`).
#[test]
#[ignore = "a measurement: scripts/bench-dial-attack.sh"]
fn victim_lookup_and_connect_with_and_without_the_attack() {
    let rounds = common::size("BUD_ATTACK_ROUNDS", 7);
    let (hanging, _filler) = hanging_listener();
    let echo = common::echo_server();
    let exec = executor();
    // One job first: the VM and its template's pages warm, as the rounds after it find them.
    let _ = victim(&exec, echo);

    measure("without the attack", &exec, echo, rounds);
    let attack_started = Instant::now();
    let attack = Attack::start(hanging.local_addr().unwrap());
    measure("during the attack", &exec, echo, rounds);
    let attackers = attack.stop();

    let took = attack_started.elapsed();
    for a in attackers {
        println!("attacker over {took:.1?}: {a}");
    }
}
