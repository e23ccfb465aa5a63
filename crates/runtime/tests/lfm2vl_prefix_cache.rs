//! The scheduler's prefix cache on the bundled miniature LFM2-VL (CPU): a request continues
//! what an idle cache slot holds — a conversation's earlier turn, a shared system prompt, the
//! same image — and prefills only the rest, kept convolution states making the answer the one
//! an empty cache gives; a prefix another slot holds is copied into a free slot rather than
//! taking that slot; the slot used least recently gives way; prompts are also prefilled in
//! chunks beside decoding sequences.

use std::path::{Path, PathBuf};

use tessera_backend::{AnyBackend, cpu::CpuBackend};
use tessera_models::chat_family::CacheShape;
use tessera_models::chat_template::{Message, Part};
use tessera_models::imageproc::Image;
use tessera_runtime::chat::{self, Chat, ChatEvent, ChatOptions, ChatReply, GenerationParams};
use tessera_runtime::decode::{Control, SamplingParams};
use tessera_runtime::{Family, ModelSpec};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn model(slots: usize, options: ChatOptions) -> Box<dyn Chat> {
    let spec = ModelSpec::bundled(Family::Lfm2Vl).unwrap();
    chat::load(
        AnyBackend::Cpu(CpuBackend::new()),
        &spec,
        CacheShape { slots, ctx: 1024 },
        options,
    )
    .unwrap()
}

fn cached(slots: usize) -> Box<dyn Chat> {
    model(
        slots,
        ChatOptions {
            prefix_cache: true,
            ..ChatOptions::default()
        },
    )
}

fn image(name: &str) -> Image {
    Image::open(&root().join("tests/fixtures/lfm2vl/images").join(name)).unwrap()
}

/// The fixture's `mini.one_image` case: its greedy tokens.
fn reference_one_image() -> Vec<u32> {
    let p = root().join("tests/fixtures/lfm2vl/cases.json");
    let cases: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    let case = cases["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["case"] == "mini.one_image")
        .unwrap();
    case["greedy"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

fn image_question(q: &str) -> Vec<Message> {
    vec![Message::parts(
        "user",
        vec![Part::Image, Part::Text { text: q.into() }],
    )]
}

fn greedy(max_tokens: usize) -> GenerationParams {
    GenerationParams {
        sampling: SamplingParams::default(),
        max_tokens,
        stop: Vec::new(),
    }
}

fn ask(m: &mut dyn Chat, conv: u64, msgs: &[Message], images: &[Image], n: usize) -> ChatReply {
    let prompt = m.prompt(msgs, images).unwrap();
    let r = m
        .reply(conv, prompt, &greedy(n), &mut |_| Control::Continue)
        .unwrap();
    m.end(conv);
    r
}

/// Token ids two prompts share at their start.
fn shared(m: &dyn Chat, a: (&[Message], &[Image]), b: (&[Message], &[Image])) -> usize {
    let (a, b) = (m.prompt(a.0, a.1).unwrap(), m.prompt(b.0, b.1).unwrap());
    a.ids.iter().zip(&b.ids).take_while(|(x, y)| x == y).count()
}

/// A conversation's next turn, sent as a new request (another conversation, as over HTTP),
/// continues the slot the first turn left and prefills only what the turn adds.
#[test]
fn a_follow_up_request_prefills_only_its_new_tokens() {
    let mut m = cached(2);
    let mut plain = model(1, ChatOptions::default());
    let img = vec![image("exact270x250.png")];
    let mut msgs = image_question("What is in this image?");
    // A one-token reply re-tokenises as generated (see lfm2vl_chat.rs), so the slot's tokens
    // (the prompt; the last sampled token is never fed) start the next prompt.
    let first = ask(m.as_mut(), 1, &msgs, &img, 1);
    assert_eq!(first.cached_tokens, 0);
    msgs.push(Message::new("assistant", &first.text));
    msgs.push(Message::new("user", "And what colour is it?"));
    let next = ask(m.as_mut(), 2, &msgs, &img, 16);
    let fresh = ask(plain.as_mut(), 1, &msgs, &img, 16);
    assert_eq!(next.tokens, fresh.tokens);
    assert_eq!(fresh.cached_tokens, 0);
    // Prefilled: the new prompt's tokens beyond the first prompt.
    assert_eq!(next.cached_tokens, first.prompt_tokens);
    assert_eq!(
        next.prompt_tokens - next.cached_tokens,
        fresh.prompt_tokens - first.prompt_tokens
    );
}

/// Two single-turn conversations with one long system prompt (over two blocks of 64 tokens).
fn sharing_a_system_prompt() -> (Vec<Message>, Vec<Message>) {
    let system = "You are a careful assistant. ".repeat(12);
    let turn = |q: &str| vec![Message::new("system", &system), Message::new("user", q)];
    (turn("Tell me a story."), turn("Name three colours."))
}

/// Requests sharing a long system prompt continue it from a kept state (a block boundary),
/// never past where they differ, with the replies an empty cache gives.
#[test]
fn a_shared_system_prompt_is_prefilled_once() {
    let (a, b) = sharing_a_system_prompt();
    let mut m = cached(2);
    let mut plain = model(1, ChatOptions::default());
    let common = shared(m.as_ref(), (&a, &[]), (&b, &[]));
    assert!(common > 128, "the system prompt is {common} tokens");
    let ra = ask(m.as_mut(), 1, &a, &[], 12);
    let rb = ask(m.as_mut(), 2, &b, &[], 12);
    assert_eq!(ra.cached_tokens, 0);
    // Kept every 64 tokens: at least all whole blocks of the shared part are reused.
    assert!(
        rb.cached_tokens <= common && rb.cached_tokens + 64 > common && rb.cached_tokens > 0,
        "{} of {common} shared tokens reused",
        rb.cached_tokens
    );
    assert_eq!(rb.tokens, ask(plain.as_mut(), 1, &b, &[], 12).tokens);
    assert_eq!(ra.tokens, ask(plain.as_mut(), 1, &a, &[], 12).tokens);
}

/// A request sharing a system prompt with an idle conversation copies the shared part (keys and
/// values, and the state kept at a block boundary) into a free slot instead of taking that
/// conversation's slot, whose next turn still continues all of it; both replies are those of
/// an empty cache.
#[test]
fn a_shared_prefix_is_copied_and_the_conversation_keeps_its_slot() {
    let (a, b) = sharing_a_system_prompt();
    let mut m = cached(2);
    let mut plain = model(1, ChatOptions::default());
    // One token: the slot then holds exactly what the next turn's prompt starts with.
    let ra = ask(m.as_mut(), 1, &a, &[], 1);
    let rb = ask(m.as_mut(), 2, &b, &[], 12);
    assert!(rb.cached_tokens >= 128, "{} reused", rb.cached_tokens);
    assert_eq!(rb.tokens, ask(plain.as_mut(), 1, &b, &[], 12).tokens);
    let mut next = a.clone();
    next.push(Message::new("assistant", &ra.text));
    next.push(Message::new("user", "Go on."));
    let rn = ask(m.as_mut(), 3, &next, &[], 8);
    assert_eq!(rn.cached_tokens, ra.prompt_tokens);
    assert_eq!(rn.tokens, ask(plain.as_mut(), 1, &next, &[], 8).tokens);
}

/// A second question about the same image continues from the image's end (its tokens are not
/// encoded again) and still answers as the reference does; another image with the same
/// placeholder tokens is never taken for it.
#[test]
fn the_same_image_is_reused_and_another_is_not() {
    let img = vec![image("exact270x250.png")];
    let mut m = cached(1);
    let prompt = m
        .prompt(&image_question("What is in this image?"), &img)
        .unwrap();
    let image_end = prompt.media[0].end;
    let first = ask(m.as_mut(), 1, &image_question("Describe it."), &img, 4);
    assert_eq!(first.cached_tokens, 0);
    let again = ask(
        m.as_mut(),
        2,
        &image_question("What is in this image?"),
        &img,
        32,
    );
    assert!(
        again.cached_tokens >= image_end,
        "{} cached, the image ends at {image_end}",
        again.cached_tokens
    );
    assert_eq!(again.tokens, reference_one_image());
    // The same size (so the same placeholder ids) with other pixels: nothing from the image on.
    let other = {
        let rgb: Vec<u8> = img[0]
            .rgb()
            .iter()
            .enumerate()
            .map(|(i, v)| v.wrapping_add(40 + (i % 7) as u8))
            .collect();
        vec![Image::from_rgb8(img[0].width(), img[0].height(), rgb).unwrap()]
    };
    let p_other = m
        .prompt(&image_question("What is in this image?"), &other)
        .unwrap();
    assert_eq!(p_other.ids, prompt.ids);
    let swapped = ask(
        m.as_mut(),
        3,
        &image_question("What is in this image?"),
        &other,
        8,
    );
    assert!(
        swapped.cached_tokens <= prompt.media[0].start,
        "{} cached",
        swapped.cached_tokens
    );
    let mut plain = model(1, ChatOptions::default());
    assert_eq!(
        swapped.tokens,
        ask(
            plain.as_mut(),
            1,
            &image_question("What is in this image?"),
            &other,
            8
        )
        .tokens
    );
}

/// With two slots, a third prompt takes the slot used least recently: that prompt's prefix is
/// gone, the other's stays.
#[test]
fn the_least_recently_used_slot_is_evicted() {
    let q = |s: &str| vec![Message::new("user", s)];
    let (a, b, c) = (
        q("Tell me a story about a cat."),
        q("Name three colours of the sea."),
        q("How far is the moon?"),
    );
    let follow = |msgs: &[Message], r: &ChatReply| {
        let mut m = msgs.to_vec();
        m.push(Message::new("assistant", &r.text));
        m.push(Message::new("user", "More."));
        m
    };
    let mut m = cached(2);
    let ra = ask(m.as_mut(), 1, &a, &[], 1);
    let rb = ask(m.as_mut(), 2, &b, &[], 1);
    let rc = ask(m.as_mut(), 3, &c, &[], 1);
    assert_eq!(
        (ra.cached_tokens, rb.cached_tokens, rc.cached_tokens),
        (0, 0, 0)
    );
    // c took a's slot; b's is still there.
    let fb = ask(m.as_mut(), 4, &follow(&b, &rb), &[], 4);
    assert_eq!(fb.cached_tokens, rb.prompt_tokens);
    let fa = ask(m.as_mut(), 5, &follow(&a, &ra), &[], 4);
    assert_eq!(fa.cached_tokens, 0);
}

/// Prompts prefilled a few tokens a step beside decoding sequences, with and without the prefix
/// cache, give the replies of whole prefills one at a time.
#[test]
fn chunked_prefills_in_a_batch_give_the_lone_replies() {
    let img = vec![image("exact270x250.png")];
    let text = vec![Message::new("user", "Tell me a story.")];
    let questions: Vec<(Vec<Message>, Vec<Image>)> = vec![
        (image_question("What is in this image?"), img.clone()),
        (text.clone(), Vec::new()),
        (image_question("Describe it."), img.clone()),
        (text.clone(), Vec::new()),
    ];
    let mut plain = model(1, ChatOptions::default());
    let lone: Vec<Vec<u32>> = questions
        .iter()
        .map(|(m, i)| ask(plain.as_mut(), 1, m, i, 12).tokens)
        .collect();
    assert_eq!(lone[0][..12], reference_one_image()[..12]);
    for prefix_cache in [false, true] {
        let mut m = model(
            4,
            ChatOptions {
                prefix_cache,
                prefill_chunk: 7,
            },
        );
        let mut done = std::collections::HashMap::new();
        let mut steps = 0;
        for (i, (msgs, imgs)) in questions.iter().enumerate() {
            let p = m.prompt(msgs, imgs).unwrap();
            m.begin(i as u64, p, &greedy(12)).unwrap();
            // Each joins while the earlier ones prefill or decode.
            for _ in 0..3 {
                steps += 1;
                m.step(&mut |c, ev| {
                    if let ChatEvent::Done(r) = ev {
                        done.insert(c, r.tokens);
                    }
                    Control::Continue
                })
                .unwrap();
            }
        }
        while m
            .step(&mut |c, ev| {
                if let ChatEvent::Done(r) = ev {
                    done.insert(c, r.tokens);
                }
                Control::Continue
            })
            .unwrap()
            > 0
        {
            steps += 1;
        }
        for (i, want) in lone.iter().enumerate() {
            assert_eq!(
                &done[&(i as u64)],
                want,
                "request {i}, prefix cache {prefix_cache}"
            );
        }
        assert!(steps > 12, "{steps} steps");
    }
}
