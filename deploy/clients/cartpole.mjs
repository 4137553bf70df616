// A client of `apex serve` in JavaScript (Node 18 or later: fetch is built in), written from
// the HTTP API's schema (GET /v1/schema) alone: it steps CartPoles of its own (Gymnasium's
// CartPole-v1 equations, not Gymnasium) and asks the server for all their actions in one
// request a step, the ends of the episodes that ended riding along. Run a learner on
// CartPole-v1 and `apex serve --http`, then:
//
//   node deploy/clients/cartpole.mjs http://127.0.0.1:8000 --envs 32 --seconds 120 [--token T]
//
// It prints the steps it played and the mean return of the episodes it finished.

const options = { envs: 32, seconds: 60, token: process.env.APEX_SERVE_TOKEN || "", seed: 0 };
const [address, ...rest] = process.argv.slice(2);
for (let i = 0; i < rest.length; i += 2) {
  const key = rest[i].replace(/^--/, "");
  if (!(key in options) || rest[i + 1] === undefined) throw new Error(`unknown or incomplete option ${rest[i]}`);
  options[key] = key === "token" ? rest[i + 1] : Number(rest[i + 1]);
}
if (!address) throw new Error("usage: node cartpole.mjs http://HOST:PORT [--envs N] [--seconds S] [--token T]");

const headers = { "Content-Type": "application/json" };
if (options.token) headers.Authorization = `Bearer ${options.token}`;

async function call(method, path, body) {
  const reply = await fetch(address + path, { method, headers, body: body && JSON.stringify(body) });
  const data = await reply.json();
  if (!reply.ok) throw new Error(`${method} ${path}: ${reply.status} ${data.error}`);
  return data;
}

// A small seeded generator (mulberry32), so that runs can be repeated.
function generator(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = Math.imul(a ^ (a >>> 15), 1 | a);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

// Gymnasium's CartPole-v1: Euler steps of 0.02 s, a force of 10 N left or right, over at a
// pole angle of 12 degrees or a cart 2.4 from the centre, cut at 500 steps.
class CartPole {
  constructor(random) {
    this.random = random;
    this.reset();
  }
  reset() {
    this.state = [0, 0, 0, 0].map(() => this.random() * 0.1 - 0.05);
    this.steps = 0;
    this.return = 0;
  }
  step(action) {
    let [x, xDot, theta, thetaDot] = this.state;
    const force = action === 1 ? 10 : -10;
    const cos = Math.cos(theta);
    const sin = Math.sin(theta);
    const temp = (force + 0.05 * thetaDot * thetaDot * sin) / 1.1;
    const thetaAcc = (9.8 * sin - cos * temp) / (0.5 * (4 / 3 - (0.1 * cos * cos) / 1.1));
    const xAcc = temp - (0.05 * thetaAcc * cos) / 1.1;
    x += 0.02 * xDot;
    xDot += 0.02 * xAcc;
    theta += 0.02 * thetaDot;
    thetaDot += 0.02 * thetaAcc;
    this.state = [x, xDot, theta, thetaDot];
    this.steps += 1;
    this.return += 1;
    const terminated = Math.abs(x) > 2.4 || Math.abs(theta) > (12 * 2 * Math.PI) / 360;
    return { reward: 1, terminated, truncated: !terminated && this.steps >= 500 };
  }
}

async function main() {
  const deadline = Date.now() + 60_000;
  for (;;) {  // started beside the server: wait for it
    try {
      await call("GET", "/v1/spaces");
      break;
    } catch (error) {
      if (Date.now() > deadline) throw error;
      await new Promise((resolve) => setTimeout(resolve, 200));
    }
  }
  const random = generator(options.seed);
  const envs = Array.from({ length: options.envs }, () => new CartPole(random));
  let ids = (await call("POST", "/v1/episodes", { count: options.envs })).episode_ids;
  let rewards = envs.map(() => 0);
  let ended = null;  // the episodes that ended last step: they end inside the next request
  let steps = 0;
  const returns = [];
  const stop = Date.now() + options.seconds * 1000;
  while (Date.now() < stop) {
    const body = { episode_ids: ids, observations: envs.map((env) => env.state), rewards };
    if (ended) body.end = ended;
    const { actions } = await call("POST", "/v1/batch/action", body);
    ended = null;
    const finished = [];
    envs.forEach((env, i) => {
      const { reward, terminated, truncated } = env.step(actions[i]);
      rewards[i] = reward;
      steps += 1;
      if (terminated || truncated) finished.push({ i, terminated, truncated });
    });
    if (finished.length) {
      ended = { episode_ids: [], observations: [], terminated: [], truncated: [], rewards: [] };
      const fresh = (await call("POST", "/v1/episodes", { count: finished.length })).episode_ids;
      finished.forEach(({ i, terminated, truncated }, k) => {
        ended.episode_ids.push(ids[i]);
        ended.observations.push(envs[i].state);
        ended.terminated.push(terminated);
        ended.truncated.push(truncated);
        ended.rewards.push(rewards[i]);
        returns.push(envs[i].return);
        ids[i] = fresh[k];
        rewards[i] = 0;  // a new episode's first request carries no reward
        envs[i].reset();
      });
    }
  }
  const last = returns.slice(-100);
  const mean = last.reduce((a, b) => a + b, 0) / Math.max(1, last.length);
  console.log(`steps ${steps} episodes ${returns.length} return_mean_100 ${mean.toFixed(1)}`);
}

main().catch((error) => {
  console.error(error.message);
  process.exit(1);
});
