"""The sentences of `vllm-tour explain`, en and zh: one template per sentence kind (views/explain.py says
which record fields and notes each is derived from)."""

from __future__ import annotations

LANGS = ("en", "zh")


MSG: dict[str, dict[str, str]] = {
    # speculative decoding (views/explain_spec.py)
    "spec_all_accepted": {
        "en": "verified the {k} drafts proposed after step {prev} ({drafts}): all {a} accepted, then the target's bonus "
              "token {bonus}: {total} tokens from one step",
        "zh": "验证了第 {prev} 步之后提出的 {k} 个草稿 token（{drafts}）：全部 {a} 个被接受，再加上目标模型的奖励（bonus）"
              "token {bonus}：一步得到 {total} 个 token",
    },
    "spec_rejected": {
        "en": "verified the {k} drafts proposed after step {prev} ({drafts}): {a} accepted; {why}; kept {kept}, "
              "the {rolled} rejected rolled back",
        "zh": "验证了第 {prev} 步之后提出的 {k} 个草稿 token（{drafts}）：{a} 个被接受；{why}；保留 {kept}，"
              "被拒绝的 {rolled} 个回滚",
    },
    "spec_why_greedy": {
        "en": "draft {i} was rejected because the target's token at its position was {target}, not the draft {draft} "
              "(greedy: a draft is kept only while it equals the target's argmax)",
        "zh": "第 {i} 个草稿 token 被拒绝，因为目标模型在该位置的 token 是 {target}，而不是草稿 token {draft}"
              "（贪心：草稿 token 只有等于目标模型的 argmax 时才被保留）",
    },
    "spec_why_sampled": {
        "en": "draft {i} ({draft}) failed the accept test (kept only when the draw u <= the target's probability of it; "
              "the records hold neither), and {target} was drawn there from the target without it",
        "zh": "第 {i} 个草稿 token（{draft}）没有通过接受检验（只有抽样值 u <= 目标模型给它的概率时才保留；记录中两者都没有），"
              "于是在该位置从去掉它的目标分布中抽出了 {target}",
    },
    "spec_cut": {
        "en": "of those {total} tokens only {kept} were appended: the request stopped there ({reason}), {dropped} dropped",
        "zh": "这 {total} 个 token 中只追加了 {kept} 个：请求在那里停止（{reason}），{dropped} 被丢弃",
    },
    "spec_dropped": {
        "en": "its {k} drafts proposed after step {prev} ({drafts}) were dropped with the preemption, never verified",
        "zh": "它在第 {prev} 步之后提出的 {k} 个草稿 token（{drafts}）随抢占被丢弃，从未被验证",
    },
    "arrival": {
        "en": "arrived before step {step} (arrival_step {arrival} in meta.requests): {tokens} prompt tokens",
        "zh": "在第 {step} 步之前到达（meta.requests 中 arrival_step = {arrival}）：提示词 {tokens} 个 token",
    },
    "arrival_early": {
        "en": "arrived before step {step}, earlier than its arrival_step {arrival}: the engine had nothing else to do "
              "(the driver adds the next request when the engine is idle): {tokens} prompt tokens",
        "zh": "在第 {step} 步之前到达，早于它的 arrival_step {arrival}：引擎当时空闲（驱动程序在引擎空闲时提前加入下一个请求）；"
              "提示词 {tokens} 个 token",
    },
    "wait_preempt_gate": {
        "en": "waited: this step preempted {victims}, and no request is admitted in a step that preempted",
        "zh": "等待：本步发生了抢占（{victims}），发生抢占的一步不准入任何请求",
    },
    "wait_budget": {
        "en": "waited: the token budget was used up ({used}/{budget} tokens went to {users})",
        "zh": "等待：token 预算已用完（{budget} 个中的 {used} 个给了 {users}）",
    },
    "wait_max_running": {
        "en": "waited: {running} requests were running, the limit max_num_seqs = {max}",
        "zh": "等待：已有 {running} 个请求在运行，达到上限 max_num_seqs = {max}",
    },
    "wait_kv": {
        "en": "waited: not enough free KV blocks -- its whole sequence of {tokens} tokens must fit to be admitted, "
              "up to ceil({tokens}/{bs}) = {need} blocks, {free} free",
        "zh": "等待：空闲 KV 块不足——准入要求整条序列（{tokens} 个 token）都放得下，最多需要 ceil({tokens}/{bs}) = {need} 块，"
              "而空闲的只有 {free} 块",
    },
    "wait_kv_nolevel": {
        "en": "waited: its KV allocation failed (budget left {left}, {running} < max_num_seqs {max} running: the only "
              "other stop of the admission walk); free blocks are not recorded at level {level}",
        "zh": "等待：它的 KV 分配失败（预算还剩 {left}，运行中 {running} < max_num_seqs {max}：准入循环没有别的停止条件）；"
              "{level} 级别的记录不含空闲块数",
    },
    "wait_no_chunking": {
        "en": "waited: chunked prefill is off and its {owed} tokens exceed the {left} tokens left of the budget",
        "zh": "等待：分块预填充已关闭，它的 {owed} 个 token 超过了预算剩余的 {left} 个",
    },
    "wait_hol": {
        "en": "waited behind {head}, which did not fit: admission stops at the first waiting request it cannot "
              "admit{fits}",
        "zh": "排在 {head} 之后等待：{head} 放不下，而准入循环在第一个无法准入的等待请求处就停止{fits}",
    },
    "hol_fits": {
        "en": " ({rid} alone needed at most {need} blocks for {tokens} tokens, and {free} were free)",
        "zh": "（{rid} 自己最多只需 {need} 块来放 {tokens} 个 token，而空闲的有 {free} 块）",
    },
    "wait_running_budget": {
        "en": "got no tokens while running: the budget was used up by requests ahead of it ({used}/{budget} to {users})",
        "zh": "处于运行状态但没分到 token：预算被排在前面的请求用完了（{budget} 个中的 {used} 个给了 {users}）",
    },
    "wait_unknown": {
        "en": "was not scheduled{queue}; the records do not establish why ({why})",
        "zh": "没有被调度{queue}；记录无法确定原因（{why}）",
    },
    "admit": {
        "en": "admitted ({kind}): {computed} of its {tokens} tokens already computed from the prefix "
              "cache, {scheduled} computed this step",
        "zh": "被准入（{kind}）：{tokens} 个 token 中 {computed} 个来自前缀缓存，本步计算 {scheduled} 个",
    },
    "chunk_budget": {
        "en": "prefill chunk of {chunk} of the {owed} tokens it still owed, cut to what was left of the "
              "budget: {budget} - {others} (to {users}) = {chunk}",
        "zh": "预填充分块 {chunk} 个 token（还欠 {owed} 个），被截到预算剩余：{budget} - {others}（给了 {users}）= {chunk}",
    },
    "chunk_threshold": {
        "en": "prefill chunk of {chunk} of the {owed} tokens it still owed, capped by "
              "long_prefill_token_threshold = {threshold}",
        "zh": "预填充分块 {chunk} 个 token（还欠 {owed} 个），被 long_prefill_token_threshold = {threshold} 限制",
    },
    "chunk_unknown": {
        "en": "prefill chunk of {chunk} of the {owed} tokens it still owed; the records do not show what "
              "cut it ({left} tokens of the budget were left)",
        "zh": "预填充分块 {chunk} 个 token（还欠 {owed} 个）；记录看不出是什么截断了它（预算还剩 {left}）",
    },
    "chunk_last": {
        "en": "last prefill chunk, the remaining {chunk} tokens",
        "zh": "最后一个预填充分块，剩下的 {chunk} 个 token",
    },
    "preempt": {
        "en": "preempted while allocating for {for_}: allocate_slots({for_}, {asked} tokens) failed with "
              "{free} free blocks; {rule}. It lost {lost} computed tokens (blocks {blocks} freed) and must recompute them",
        "zh": "为 {for_} 分配时被抢占：allocate_slots({for_}, {asked} 个 token) 在只有 {free} 个空闲块时失败；"
              "{rule}。它丢失了 {lost} 个已计算的 token（释放块 {blocks}），必须重新计算",
    },
    "rule_last": {
        "en": "the victim is the last running request (FCFS), and {rid} was last of {running}",
        "zh": "FCFS 策略下牺牲者是运行队列的最后一个，而 {rid} 正是 {running} 中的最后一个",
    },
    "rule_self": {
        "en": "{rid} was the last running request itself, with no one left behind it to preempt",
        "zh": "{rid} 自己就是运行队列的最后一个，后面已没有可以抢占的请求",
    },
    "rule_priority": {
        "en": "under the priority policy the victim is the worst (priority, arrival) running request",
        "zh": "优先级策略下，牺牲者是运行队列中 (priority, arrival) 最差的请求",
    },
    "rule_unverified": {
        "en": "the victim is the last running request (FCFS); the rebuilt running list does not confirm it here",
        "zh": "FCFS 策略下牺牲者是运行队列的最后一个；此处重建的运行队列无法印证这一点",
    },
    "preempted_other": {
        "en": "its allocation ({asked} tokens, {free} free blocks) failed and {victim} was preempted for it "
              "({lost} computed tokens lost)",
        "zh": "它的分配（{asked} 个 token，空闲 {free} 块）失败，{victim} 为它被抢占（丢失 {lost} 个已计算 token）",
    },
    "resume": {
        "en": "back (resumed, {waited} steps after the preemption): {hit} of its {tokens} tokens from "
              "the prefix cache, {recompute} recomputed",
        "zh": "恢复运行（抢占后 {waited} 步）：{tokens} 个 token 中 {hit} 个来自前缀缓存，重新计算 {recompute} 个",
    },
    "cache_off": {
        "en": "prefix cache: off in this run (enable_prefix_caching false): all {tokens} tokens computed",
        "zh": "前缀缓存：本次运行未开启（enable_prefix_caching 为 false）：{tokens} 个 token 全部计算",
    },
    "cache_hit": {
        "en": "prefix cache: hit {hit} of {tokens} tokens (blocks {blocks}); at most {cacheable} could hit",
        "zh": "前缀缓存：{tokens} 个 token 命中 {hit} 个（块 {blocks}）；最多可命中 {cacheable} 个",
    },
    "cache_uncacheable": {
        "en": "the last {rest} tokens can never hit: only full blocks are cached, and the last token is always "
              "recomputed (hits stop at num_tokens - 1 = {cap}, whole blocks of {bs})",
        "zh": "最后 {rest} 个 token 永远不会命中：只有满块才会被缓存，且最后一个 token 总要重算（命中上限 num_tokens - 1 = {cap}，"
              "按 {bs} 的整块计）",
    },
    "cache_too_short": {
        "en": "none of its {tokens} tokens can hit: a hit is whole blocks of {bs} before the last token, which is "
              "always recomputed (hits stop at num_tokens - 1 = {cap})",
        "zh": "它的 {tokens} 个 token 都不可能命中：命中只算最后一个 token 之前的 {bs} 整块，而最后一个 token 总要重算"
              "（命中上限 num_tokens - 1 = {cap}）",
    },
    "miss_evicted": {
        "en": "block {i} (tokens {a}-{b}) missed: it was cached in block {block} ({owner}) and evicted at step {step} "
              "to make room for {by}",
        "zh": "第 {i} 块（token {a}-{b}）未命中：它曾缓存在块 {block}（{owner}）中，第 {step} 步为给 {by} 腾地方被驱逐",
    },
    "miss_first": {
        "en": "block {i} (tokens {a}-{b}) missed: no request had computed these tokens before (first seen here)",
        "zh": "第 {i} 块（token {a}-{b}）未命中：此前没有任何请求计算过这些 token（首次出现）",
    },
    "miss_same_step": {
        "en": "block {i} (tokens {a}-{b}) missed: {other} computes the same tokens in this step, but was admitted after it",
        "zh": "第 {i} 块（token {a}-{b}）未命中：{other} 在同一步计算相同的 token，但它在本请求之后才被准入",
    },
    "miss_later": {
        "en": "block {i} (tokens {a}-{b}) missed: {other} has the same tokens but computed them only at step {step}",
        "zh": "第 {i} 块（token {a}-{b}）未命中：{other} 有相同的 token，但直到第 {step} 步才计算",
    },
    "miss_unknown": {
        "en": "block {i} (tokens {a}-{b}) missed; the records do not establish why ({why})",
        "zh": "第 {i} 块（token {a}-{b}）未命中；记录无法确定原因（{why}）",
    },
    "miss_chain": {
        "en": "the hit ends at the first missing block: later blocks cannot hit after a miss",
        "zh": "命中在第一个未命中的块处结束：未命中之后的块不可能再命中",
    },
    "finish": {
        "en": "finished: {reason} ({generated} tokens generated){freed}",
        "zh": "结束：{reason}（生成了 {generated} 个 token）{freed}",
    },
    "freed_at": {"en": "; its blocks were freed at step {step} (kv.freed)", "zh": "；它的块在第 {step} 步释放（kv.freed）"},
    "finish_length": {"en": "max_tokens = {max} reached", "zh": "达到 max_tokens = {max}"},
    "finish_model_len": {"en": "max_model_len reached", "zh": "达到 max_model_len"},
    "finish_stop": {"en": "the model produced EOS or a stop token", "zh": "模型生成了 EOS 或停止 token"},
    "finish_other": {"en": "finish reason {reason}", "zh": "结束原因 {reason}"},
    "unfinished": {
        "en": "did not finish in the records (run status {status})",
        "zh": "在记录中没有结束（运行状态 {status}）",
    },
    "never_scheduled": {
        "en": "was never scheduled in the recorded steps",
        "zh": "在记录的各步中从未被调度",
    },
    "level": {
        "en": "recorded at level {level}: {what} need records of level blocks (record again with --level blocks)",
        "zh": "记录级别为 {level}：{what}需要 blocks 级别的记录（用 --level blocks 重新记录）",
    },
    "level_what": {
        "en": "free-block counts, prefix-cache miss causes and evictions",
        "zh": "空闲块数、前缀缓存未命中的原因与驱逐",
    },
    "arrival_served": {
        "en": "arrived through the API as {api} ({t} s into the run, at the front end): {tokens} prompt tokens; in the "
              "engine's waiting queue by step {step}",
        "zh": "通过 API 到达，客户端拿到的 id 是 {api}（前端在运行开始后 {t} 秒收到）：提示词 {tokens} 个 token；第 {step} 步时已在引擎的等待队列中",
    },
    "arrival_served_unknown": {
        "en": "arrived through the API as {api} ({t} s into the run, at the front end): {tokens} prompt tokens; the step it "
              "reached the engine by is not established (the recorded waiting counts do not fit the front end's arrivals)",
        "zh": "通过 API 到达，客户端拿到的 id 是 {api}（前端在运行开始后 {t} 秒收到）：提示词 {tokens} 个 token；它在哪一步之前进入引擎无法确定"
              "（记录的等待数量与前端的到达时间对不上）",
    },
    "served_unrecorded": {
        "en": "the server's front end recorded nothing for this request: its API id and arrival are not known",
        "zh": "服务器前端没有记录这个请求：它的 API id 与到达时间未知",
    },
    "served_child": {
        "en": "one of the n = {n} choices the client asked for in {api} (index {index}): the front end made one engine "
              "request per choice under the parent {parent}; the other(s): {others}",
        "zh": "客户端在 {api} 中要求 n = {n} 个候选，这是其中之一（序号 {index}）：前端为每个候选建一个引擎请求，父请求为 {parent}；"
              "其余：{others}",
    },
    "abort": {
        "en": "aborted: {who}. The engine dropped it while {status} (Scheduler.finish_requests, FINISHED_ABORTED) with "
              "{computed} computed tokens and {outputs} generated, holding blocks {held}; {freed}{kept}. When the client "
              "hung up is not recorded: this is the step the engine dropped it",
        "zh": "被中止：{who}。引擎在它处于 {status} 状态时丢弃了它（Scheduler.finish_requests，FINISHED_ABORTED），"
              "当时已计算 {computed} 个 token、生成 {outputs} 个，持有块 {held}；{freed}{kept}。客户端何时断开没有记录：这是引擎丢弃它的那一步",
    },
    "abort_client": {
        "en": "the client closed the stream (the front end reported finish_reason abort after {tokens} tokens, and the "
              "server went on serving: {later} arrived later)",
        "zh": "客户端关闭了流（前端在 {tokens} 个 token 之后报告 finish_reason abort，且服务器之后仍在服务：{later} 在它之后到达）",
    },
    "abort_stop_string": {
        "en": "the front end found a stop string{stop} in its text (finish_reason stop), and the engine, which does not "
              "look for stop strings, was told to drop it",
        "zh": "前端在它的文本中发现了停止字符串{stop}（finish_reason stop），而引擎自己不查找停止字符串，于是被告知丢弃它",
    },
    "abort_unknown": {
        "en": "the records do not say who ended it (finish reason {finish})",
        "zh": "记录无法说明是谁结束了它（结束原因 {finish}）",
    },
    "abort_client_or_shutdown": {
        "en": "the client closed the stream or the server shut down, the records do not say which (nothing arrived after it)",
        "zh": "客户端关闭了流，或服务器在关闭，记录无法区分（它之后没有请求到达）",
    },
    "abort_freed_at": {
        "en": "blocks {blocks} went back to the free list (step {next}'s kv.freed)",
        "zh": "块 {blocks} 回到了空闲队列（第 {next} 步的 kv.freed）",
    },
    "abort_freed_unseen": {
        "en": "blocks {blocks} went back to the free list (no later step recorded them in kv.freed)",
        "zh": "块 {blocks} 回到了空闲队列（之后没有哪一步在 kv.freed 中记录它们）",
    },
    "abort_none_freed": {"en": "none went back to the free list", "zh": "没有块回到空闲队列"},
    "abort_kept": {
        "en": "; blocks {kept} kept a reference (another request shares them, or upstream defers them)",
        "zh": "；块 {kept} 仍有引用（另一个请求共享它们，或上游推迟释放）",
    },
    "alloc_head": {
        "en": "new blocks {blocks}: the head of the free queue, rebuilt from the records under {pin}'s rule: {rule}",
        "zh": "新块 {blocks}：空闲队列的队首（按 {pin} 的规则由记录重建）：{rule}",
    },
    "alloc_mismatch": {
        "en": "new blocks {blocks}; the free queue rebuilt under {pin}'s rule ({rule}) has {expected} at its head: the "
              "records do not establish why these",
        "zh": "新块 {blocks}；按 {pin} 的规则（{rule}）重建的空闲队列队首是 {expected}：记录无法确定为什么是这些块",
    },
    "alloc_lost": {
        "en": "new blocks {blocks}; the rebuilt free queue lost track at an earlier step, so why these is not established",
        "zh": "新块 {blocks}；重建的空闲队列在更早的一步已对不上，所以无法确定为什么是这些块",
    },
    "alloc_policy_unknown": {
        "en": "new blocks {blocks}; which free blocks are handed out first is not known here: {why}",
        "zh": "新块 {blocks}；此处不知道哪些空闲块先被分出：{why}",
    },
    "rule_append_all": {
        "en": "BlockPool.free_blocks appends every freed block at the back, cached or not (free_queue_policy = "
              "append_all, pins/{pin}.toml)",
        "zh": "BlockPool.free_blocks 把每个被释放的块都追加到队尾，不论是否带缓存（free_queue_policy = append_all，pins/{pin}.toml）",
    },
    "rule_uncached_to_front": {
        "en": "BlockPool.free_blocks puts freed blocks without a hash at the front (reused first) and cached ones at "
              "the back (free_queue_policy = uncached_to_front, pins/{pin}.toml)",
        "zh": "BlockPool.free_blocks 把没有哈希的释放块放到队首（最先复用），带缓存的放到队尾（free_queue_policy = "
              "uncached_to_front，pins/{pin}.toml）",
    },
    "queue_mismatch": {
        "en": " (the rebuilt queues do not match the recorded waiting/running counts at this step)",
        "zh": "（本步重建的队列与记录的 waiting/running 数量不符）",
    },
    "step_budget": {
        "en": "budget {budget} tokens; {users} = {used}; {left} left",
        "zh": "预算 {budget} 个 token；{users} = {used}；剩余 {left}",
    },
    "step_finished": {
        "en": "finished before this step, their blocks freed now: {who}",
        "zh": "在本步之前结束、其块在本步释放的请求：{who}",
    },
}

# Words inside sentences that are values, translated for zh.
MORE = {"en": "... {n} more: vllm-tour explain --request", "zh": "……还有 {n} 条：见 vllm-tour explain --request"}
KIND_WORDS = {"new": {"en": "new", "zh": "新请求"}, "resumed": {"en": "resumed", "zh": "恢复"}}


def msg(key: str, lang: str, **params) -> str:
    return MSG[key][lang].format(**params)
